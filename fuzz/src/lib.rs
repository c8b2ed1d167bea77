//! Shared by the fuzz targets: outcome counters (how many inputs reached the
//! comparison), a small deterministic PRNG, and the structured layer-forward case
//! of `chunked_vs_reference` and `cuda_vs_reference`.

pub mod case;
pub mod dump_file;
/// Flat keys laid out paged (SPEC 10): the property tests' helper, shared.
#[path = "../../tests/common/paging.rs"]
pub mod paging;
#[cfg(test)]
mod seeds;
pub mod verdict_case;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Mutex, Once};

use dsa_indexer::Error;

/// Per-process outcome counters. Each target calls [`Stats::input`] once per input,
/// then [`Stats::reached`] when the input got to the comparison, or [`Stats::note`]
/// with why it did not (a typed error, which is also checked). Printed to stderr at
/// powers of two, every 2^17 inputs, and at exit (libFuzzer exits through `exit`).
pub struct Stats {
    target: Mutex<&'static str>,
    total: AtomicU64,
    reached: AtomicU64,
    notes: Mutex<BTreeMap<String, u64>>,
}

/// The process's counters (one target per process).
pub static STATS: Stats = Stats {
    target: Mutex::new("?"),
    total: AtomicU64::new(0),
    reached: AtomicU64::new(0),
    notes: Mutex::new(BTreeMap::new()),
};

static AT_EXIT: Once = Once::new();

extern "C" fn report_at_exit() {
    STATS.print("exit");
}

impl Stats {
    /// Count one input of `target`.
    pub fn input(&self, target: &'static str) {
        AT_EXIT.call_once(|| {
            *self.target.lock().unwrap() = target;
            // SAFETY: registers a plain `extern "C" fn()` that only reads atomics and a mutex.
            unsafe {
                libc::atexit(report_at_exit);
            }
        });
        let n = self.total.fetch_add(1, Relaxed) + 1;
        if (n >= 1024 && n.is_power_of_two()) || n.is_multiple_of(1 << 17) {
            self.print("progress");
        }
    }

    /// The current input reached the comparison.
    pub fn reached(&self) {
        self.reached.fetch_add(1, Relaxed);
    }

    /// The current input stopped before the comparison, for this reason.
    pub fn note(&self, why: impl Into<String>) {
        *self.notes.lock().unwrap().entry(why.into()).or_insert(0) += 1;
    }

    /// Print `[fuzz-stats] target inputs reached (share) notes...` to stderr.
    pub fn print(&self, when: &str) {
        let total = self.total.load(Relaxed);
        let reached = self.reached.load(Relaxed);
        let share = if total == 0 {
            0.0
        } else {
            100.0 * reached as f64 / total as f64
        };
        let notes = self
            .notes
            .lock()
            .map(|m| {
                m.iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .unwrap_or_default();
        let target = self.target.lock().map(|t| *t).unwrap_or("?");
        eprintln!(
            "[fuzz-stats] {when} target={target} inputs={total} reached={reached} ({share:.1}%) {notes}"
        );
    }
}

/// The variant name of an error, for the counters.
pub fn kind(e: &Error) -> &'static str {
    match e {
        Error::OutOfRange { .. } => "OutOfRange",
        Error::Shape { .. } => "Shape",
        Error::NanE4m3 { .. } => "NanE4m3",
        Error::ReservedScale { .. } => "ReservedScale",
        Error::BadFloat { .. } => "BadFloat",
        Error::Overflow { .. } => "Overflow",
        Error::CandidateMismatch { .. } => "CandidateMismatch",
        Error::Dump { .. } => "Dump",
        Error::Backend { .. } => "Backend",
    }
}

/// splitmix64: fills tensors from a fuzzer-chosen seed, so inputs stay small.
#[derive(Debug, Clone)]
pub struct Rng(pub u64);

impl Rng {
    /// Next 64 random bits. (Not an `Iterator`: it never ends, and its callers want a
    /// `u64`, not an `Option`.)
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    /// An element of a non-empty palette, or `fallback()` when the palette is empty.
    pub fn pick<T: Copy>(&mut self, palette: &[T], fallback: impl FnOnce(&mut Self) -> T) -> T {
        if palette.is_empty() {
            fallback(self)
        } else {
            palette[self.below(palette.len())]
        }
    }
}
