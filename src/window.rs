//! The processing window a route publishes: how long its executions take, so that a caller
//! can set deadlines that outlast it and a duplicate is told when to come back.
//!
//! Each guarded route keeps the durations of its last [`SAMPLES`] executions (from the
//! handler's start to its whole answer: a streamed answer's end, a failure, or the moment an
//! execution was abandoned, which counts as at least that long) and their 99th percentile,
//! kept exact: recomputed (one pass over the samples, on the execution's task) only when a
//! sample could move it, which once the window is full is about one execution in forty.
//! Writing a sample is three atomic operations; the percentile is read from one. A
//! `409 in-flight` answer's `Retry-After` is the time the holder has left by that percentile
//! (rather than the whole lease), and [`ProcessingWindow`] publishes it, with the
//! route's TTL, for tool descriptions and clients: in process
//! ([`IdempotencyLayer::processing_windows`](crate::IdempotencyLayer::processing_windows)), and
//! over HTTP as a JSON document a caller reads before calling
//! ([`WindowsService`](crate::window_document::WindowsService)).

use std::fmt;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use serde_json::{Value, json};

/// How many recent executions the percentile is taken over.
const SAMPLES: usize = 256;
/// No percentile yet.
const NONE: u64 = u64::MAX;

/// The recent execution times of one route.
pub(crate) struct Window {
    samples: Box<[AtomicU32]>,
    next: AtomicUsize,
    p99_ms: AtomicU64,
}

impl Default for Window {
    fn default() -> Self {
        Self {
            samples: (0..SAMPLES).map(|_| AtomicU32::new(0)).collect(),
            next: AtomicUsize::new(0),
            p99_ms: AtomicU64::new(NONE),
        }
    }
}

impl fmt::Debug for Window {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Window")
            .field("executions", &self.executions())
            .field("p99", &self.p99())
            .finish()
    }
}

impl Window {
    /// Notes one execution that took `took`.
    pub(crate) fn record(&self, took: Duration) {
        // Whole milliseconds, rounded up: a window is never shorter than what it measured.
        let ms = u32::try_from(ceil_ms(took)).unwrap_or(u32::MAX);
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        // Stored as ms + 1: 0 marks a slot not yet written.
        let new = ms.saturating_add(1);
        let old = self.samples[n % SAMPLES].swap(new, Ordering::Relaxed);
        let written = n + 1;
        if written <= SAMPLES
            || written.is_multiple_of(SAMPLES)
            || moves(self.p99_ms.load(Ordering::Relaxed), new, old)
        {
            self.recompute();
        }
    }

    fn recompute(&self) {
        if let Some(p99) = p99_of(self.samples.iter().map(|s| s.load(Ordering::Relaxed))) {
            self.p99_ms.store(u64::from(p99 - 1), Ordering::Relaxed);
        }
    }

    /// The 99th percentile of the recent executions, once there is one.
    pub(crate) fn p99(&self) -> Option<Duration> {
        match self.p99_ms.load(Ordering::Relaxed) {
            NONE => None,
            ms => Some(Duration::from_millis(ms)),
        }
    }

    /// How many executions it has seen.
    pub(crate) fn executions(&self) -> u64 {
        self.next.load(Ordering::Relaxed) as u64
    }
}

/// One execution being timed: its duration goes into the route's window when this is dropped,
/// however the execution ends (its answer read whole, its stream over, a panic, or abandoned).
pub(crate) struct Timing {
    window: std::sync::Arc<Window>,
    started: std::time::Instant,
}

impl Timing {
    /// Starts timing an execution on the route of `window`.
    pub(crate) fn start(window: std::sync::Arc<Window>) -> Self {
        Self {
            window,
            started: std::time::Instant::now(),
        }
    }
}

impl Drop for Timing {
    fn drop(&mut self) {
        self.window.record(self.started.elapsed());
    }
}

/// What a guarded route publishes to its callers: how long its executions take and how long
/// its keys are kept (see [`IdempotencyLayer::processing_windows`]).
///
/// [`IdempotencyLayer::processing_windows`]: crate::IdempotencyLayer::processing_windows
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ProcessingWindow {
    /// The route, as given to `for_path` (`None`: the layer's defaults, for every other path).
    pub route: Option<String>,
    /// The 99th percentile of its recent executions (from the handler's start to its whole
    /// answer; an answer too large to record is timed until the rest of it has been sent on,
    /// so a client that reads it slowly lengthens it; an abandoned execution counts as long as
    /// it ran), once one has run.
    pub p99: Option<Duration>,
    /// How many executions it has measured.
    pub executions: u64,
    /// How long a claim holds without renewal: until the first execution, the window is taken
    /// to be this long.
    pub lease: Duration,
    /// How long a recorded outcome is replayed; a retry after this is a new request.
    pub ttl: Duration,
}

impl ProcessingWindow {
    /// The least deadline a caller should give one attempt (and a whole call): the route's
    /// p99, or its lease until it has one, rounded up to whole seconds. A shorter deadline
    /// gives up on calls that would have answered, and its retry only waits on the first.
    pub fn min_deadline(&self) -> Duration {
        let window = self.p99.unwrap_or(self.lease);
        Duration::from_secs(crate::decide::ceil_secs(window))
    }

    /// One sentence for a tool's description (an MCP server puts it in the tool's
    /// `description` or `_meta`): the deadline a retry needs and how long keys are kept.
    pub fn describe(&self) -> String {
        format!(
            "Safe to retry with the same idempotency key: give each attempt a deadline over \
             {} s (this operation's processing window), and retries reach the first outcome \
             for {} after it.",
            self.min_deadline().as_secs(),
            human(self.ttl)
        )
    }

    /// The window as JSON, as [`WindowsService`](crate::WindowsService) serves it: `route` (`null` for the defaults),
    /// `p99_ms` (`null` until measured), `executions`, `lease_ms`, `ttl_ms`, and
    /// `min_deadline_s`, the least deadline a caller should give an attempt. Durations are in
    /// whole milliseconds, rounded up: never shorter than what they stand for.
    pub fn to_json(&self) -> Value {
        json!({
            "route": self.route,
            "p99_ms": self.p99.map(ceil_ms),
            "executions": self.executions,
            "lease_ms": ceil_ms(self.lease),
            "ttl_ms": ceil_ms(self.ttl),
            "min_deadline_s": self.min_deadline().as_secs(),
        })
    }

    /// A window read back from [`to_json`](Self::to_json)'s form (a client reading a server's
    /// document); `None` if a field is missing or of the wrong type.
    pub fn from_json(value: &Value) -> Option<Self> {
        let route = match &value["route"] {
            Value::Null => None,
            Value::String(route) => Some(route.clone()),
            _ => return None,
        };
        let p99 = match &value["p99_ms"] {
            Value::Null => None,
            ms => Some(Duration::from_millis(ms.as_u64()?)),
        };
        Some(Self {
            route,
            p99,
            executions: value["executions"].as_u64()?,
            lease: Duration::from_millis(value["lease_ms"].as_u64()?),
            ttl: Duration::from_millis(value["ttl_ms"].as_u64()?),
        })
    }
}

/// The 99th percentile (nearest rank: with fewer than 100 samples, the largest) of the written
/// slots (non-zero) among at most [`SAMPLES`]. Below 400 samples that is one of the four
/// largest, so one pass keeping those replaces a copy and a selection: it runs on the
/// execution's task when a sample could move the percentile (see [`moves`]).
fn p99_of(slots: impl Iterator<Item = u32>) -> Option<u32> {
    const { assert!(SAMPLES < 400) };
    // The four largest, largest first.
    let (mut n, mut top) = (0usize, [0u32; 4]);
    for ms in slots.filter(|&ms| ms > 0) {
        n += 1;
        if ms > top[3] {
            let mut i = 3;
            while i > 0 && top[i - 1] < ms {
                top[i] = top[i - 1];
                i -= 1;
            }
            top[i] = ms;
        }
    }
    // Its index in ascending order, then from the top.
    let rank = (n * 99).div_ceil(100).checked_sub(1)?;
    top.get(n - 1 - rank).copied()
}

/// Whether a full window's percentile `p99_ms` (the k-th largest sample, k fixed once the
/// window is full) can change when sample `new` replaces `old` (both stored as ms + 1). It
/// cannot when `new` is at most the percentile and `old` below it, nor when `new` equals it and
/// `old` is above it: either way as many samples are above it, and as many at or above, as
/// before. So most executions skip the pass over the samples, and the percentile is still
/// that of the last [`SAMPLES`] after each one (a pass every [`SAMPLES`] executions mends what
/// racing writers may have left).
fn moves(p99_ms: u64, new: u32, old: u32) -> bool {
    if p99_ms == NONE {
        return true;
    }
    let (p99, new, old) = (p99_ms + 1, u64::from(new), u64::from(old));
    new > p99 || (new < p99 && old >= p99)
}

/// Whole milliseconds, rounded up: never shorter than the duration.
fn ceil_ms(d: Duration) -> u64 {
    // In `u64`: `as_micros` is a `u128`, whose division is a call of its own on every execution.
    d.as_secs()
        .saturating_mul(1000)
        .saturating_add(u64::from(d.subsec_micros().div_ceil(1000)))
}

/// A duration in the largest whole unit that fits it (whole milliseconds under a second).
fn human(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0 => format!("{} ms", d.as_millis()),
        s if s >= 86_400 && s.is_multiple_of(86_400) => format!("{} d", s / 86_400),
        s if s >= 3_600 && s.is_multiple_of(3_600) => format!("{} h", s / 3_600),
        s if s >= 60 && s.is_multiple_of(60) => format!("{} min", s / 60),
        s => format!("{s} s"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_is_the_99th_percentile_of_recent_executions() {
        let window = Window::default();
        assert_eq!(window.p99(), None, "nothing measured yet");
        window.record(Duration::from_micros(1_500));
        assert_eq!(window.p99(), Some(Duration::from_millis(2)), "rounded up");
        for _ in 0..98 {
            window.record(Duration::from_millis(10));
        }
        window.record(Duration::from_secs(9));
        // 100 samples: the 99th is 10 ms, the slow outlier is the 100th.
        for _ in 0..16 {
            window.record(Duration::from_millis(10));
        }
        assert_eq!(window.p99(), Some(Duration::from_millis(10)));
        // Old samples leave: only the last 256 count.
        for _ in 0..SAMPLES {
            window.record(Duration::from_millis(400));
        }
        assert_eq!(window.p99(), Some(Duration::from_millis(400)));
        assert_eq!(window.executions(), (1 + 98 + 1 + 16 + SAMPLES) as u64);
    }

    /// The percentile skips its pass only where it cannot move ([`moves`]): after every
    /// execution it is the nearest-rank 99th percentile of the last [`SAMPLES`], against a
    /// sorted copy, for runs heavy with ties (few distinct values), spread out, or with rare
    /// outliers, across many turns of the ring.
    #[test]
    fn the_percentile_is_exact_after_every_execution() {
        use proptest::prelude::*;
        let value = prop_oneof![
            4 => 0u64..4,
            2 => 0u64..2_000,
            1 => 1_000u64..100_000,
        ];
        let config = ProptestConfig {
            cases: 64,
            failure_persistence: None,
            ..ProptestConfig::default()
        };
        proptest!(config, |(run in proptest::collection::vec(value, 1..1_200))| {
            let window = Window::default();
            let mut last = std::collections::VecDeque::new();
            for (i, ms) in run.into_iter().enumerate() {
                window.record(Duration::from_millis(ms));
                last.push_back(ms);
                if last.len() > SAMPLES {
                    last.pop_front();
                }
                let mut sorted: Vec<u64> = last.iter().copied().collect();
                sorted.sort_unstable();
                let rank = (sorted.len() * 99).div_ceil(100) - 1;
                let expected = Duration::from_millis(sorted[rank]);
                prop_assert_eq!(window.p99(), Some(expected), "after execution {}", i + 1);
            }
        });
    }

    /// `ceil_ms` in `u64` rounds as the `u128` form it replaced: whole microseconds, rounded up
    /// to milliseconds, saturating.
    #[test]
    fn whole_milliseconds_round_up_as_the_wide_form_did() {
        let wide = |d: Duration| u64::try_from(d.as_micros().div_ceil(1000)).unwrap_or(u64::MAX);
        let mut cases = vec![
            Duration::ZERO,
            Duration::MAX,
            Duration::from_secs(u64::MAX / 1000 + 1),
        ];
        for secs in [0, 1, 59, 3_600, u64::MAX / 1000 - 1, u64::MAX / 1000] {
            for nanos in [
                0,
                1,
                999,
                1_000,
                1_001,
                999_999,
                1_000_000,
                1_000_001,
                999_999_999,
            ] {
                cases.push(Duration::new(secs, nanos));
            }
        }
        for d in cases {
            assert_eq!(ceil_ms(d), wide(d), "{d:?}");
        }
    }

    /// The one-pass percentile is the nearest-rank percentile of a sorted copy, for every
    /// count of samples up to the window's and any values (repeats, outliers, unwritten slots).
    #[test]
    fn the_one_pass_percentile_is_the_sorted_ones() {
        use proptest::prelude::*;
        let sorted = |slots: &[u32]| {
            let mut taken: Vec<u32> = slots.iter().copied().filter(|&ms| ms > 0).collect();
            taken.sort_unstable();
            let rank = (taken.len() * 99).div_ceil(100).checked_sub(1)?;
            taken.get(rank).copied()
        };
        proptest!(|(slots in proptest::collection::vec(
            prop_oneof![Just(0u32), 1u32..4, 1u32..u32::MAX],
            0..=SAMPLES,
        ))| {
            prop_assert_eq!(p99_of(slots.iter().copied()), sorted(&slots));
        });
        for n in 0..=SAMPLES {
            // Distinct values in descending order: the worst order for the kept four.
            let slots: Vec<u32> = (1..=n as u32).rev().collect();
            assert_eq!(p99_of(slots.iter().copied()), sorted(&slots), "{n} samples");
        }
    }

    #[test]
    fn a_window_describes_itself_for_a_tool() {
        let window = ProcessingWindow {
            route: Some("/tools/deploy".into()),
            p99: Some(Duration::from_millis(2_300)),
            executions: 40,
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(86_400),
        };
        assert_eq!(window.min_deadline(), Duration::from_secs(3));
        let text = window.describe();
        assert!(text.contains("over 3 s"), "{text}");
        assert!(text.contains("for 1 d"), "{text}");
        assert_eq!(
            ProcessingWindow::from_json(&window.to_json()),
            Some(window.clone()),
            "read back as written"
        );
        // To the millisecond, rounded up; under a second, said in milliseconds.
        let brief = ProcessingWindow {
            ttl: Duration::from_millis(500),
            lease: Duration::from_micros(30_500),
            ..window.clone()
        };
        let read = ProcessingWindow::from_json(&brief.to_json()).expect("a window");
        assert_eq!(read.ttl, Duration::from_millis(500));
        assert_eq!(read.lease, Duration::from_millis(31));
        assert!(
            brief.describe().contains("for 500 ms"),
            "{}",
            brief.describe()
        );
        let unmeasured = ProcessingWindow {
            p99: None,
            route: None,
            ..window
        };
        assert_eq!(unmeasured.min_deadline(), Duration::from_secs(30));
        let json = unmeasured.to_json();
        assert_eq!(json["p99_ms"], Value::Null);
        assert_eq!(json["min_deadline_s"], 30);
        assert_eq!(ProcessingWindow::from_json(&json), Some(unmeasured));
        for broken in [
            json!({}),
            json!({"route": 7, "p99_ms": null, "executions": 0, "lease_ms": 1, "ttl_ms": 1}),
            json!({"route": null, "p99_ms": "1", "executions": 0, "lease_ms": 1, "ttl_ms": 1}),
            json!({"route": null, "p99_ms": null, "executions": -1, "lease_ms": 1, "ttl_ms": 1}),
        ] {
            assert_eq!(ProcessingWindow::from_json(&broken), None, "{broken}");
        }
    }
}
