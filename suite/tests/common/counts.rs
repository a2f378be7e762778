//! [`Counts`]: a metrics recorder that counts what the crate reports, by name, for tests that
//! check its counters and gauges.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use metrics::{
    Counter, CounterFn, Gauge, GaugeFn, Histogram, Key, KeyName, Metadata, Recorder, SharedString,
    Unit,
};

/// Every counter and gauge registered, by name; cloning shares them.
#[derive(Default, Clone)]
pub struct Counts(Arc<Mutex<BTreeMap<String, Arc<AtomicU64>>>>);

struct Cell(Arc<AtomicU64>);

impl CounterFn for Cell {
    fn increment(&self, value: u64) {
        self.0.fetch_add(value, Ordering::SeqCst);
    }

    fn absolute(&self, value: u64) {
        self.0.store(value, Ordering::SeqCst);
    }
}

impl GaugeFn for Cell {
    fn increment(&self, value: f64) {
        self.0.fetch_add(value as u64, Ordering::SeqCst);
    }

    fn decrement(&self, value: f64) {
        self.0.fetch_sub(value as u64, Ordering::SeqCst);
    }

    fn set(&self, value: f64) {
        self.0.store(value as u64, Ordering::SeqCst);
    }
}

impl Counts {
    /// The value under `name` (0 if never registered).
    pub fn get(&self, name: &str) -> u64 {
        let map = self.0.lock().expect("lock");
        map.get(name).map_or(0, |c| c.load(Ordering::SeqCst))
    }

    /// The names registered so far.
    pub fn names(&self) -> Vec<String> {
        self.0.lock().expect("lock").keys().cloned().collect()
    }

    /// One recorder for the whole test binary, installed globally at first use (nextest runs
    /// each test in a process of its own; deltas keep a test honest under `cargo test` too).
    pub fn global() -> &'static Counts {
        static COUNTS: OnceLock<Counts> = OnceLock::new();
        COUNTS.get_or_init(|| {
            let counts = Counts::default();
            metrics::set_global_recorder(counts.clone()).expect("the only recorder in this binary");
            counts
        })
    }
}

impl Recorder for Counts {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    /// The crate's counters carry no labels and count under its own target.
    fn register_counter(&self, key: &Key, metadata: &Metadata<'_>) -> Counter {
        assert!(
            key.labels().next().is_none(),
            "{}: the counters carry no labels",
            key.name()
        );
        assert!(
            metadata.target().starts_with("tower_idempotency"),
            "{}: counted under target {}",
            key.name(),
            metadata.target()
        );
        let mut map = self.0.lock().expect("lock");
        let cell = map.entry(key.name().to_owned()).or_default().clone();
        Counter::from_arc(Arc::new(Cell(cell)))
    }

    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        let mut map = self.0.lock().expect("lock");
        let cell = map.entry(key.name().to_owned()).or_default().clone();
        Gauge::from_arc(Arc::new(Cell(cell)))
    }

    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::noop()
    }
}
