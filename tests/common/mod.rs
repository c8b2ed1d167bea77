//! Shared helpers and proptest strategies.
#![allow(dead_code)]

pub mod paging;
pub mod strategies;

use std::path::PathBuf;

/// The repository's `tests/golden`, or `$DSA_GOLDEN_DIR`.
pub fn golden_dir() -> PathBuf {
    if let Ok(d) = std::env::var("DSA_GOLDEN_DIR") {
        return PathBuf::from(d);
    }
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

/// Every flat-key golden layer-forward file (not the quantizer file, not the `paged/`
/// subfolder, which the paged-key decode path reads), sorted.
pub fn golden_files() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(golden_dir())
        .expect("golden directory tests/golden (or $DSA_GOLDEN_DIR)")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .filter(|p| {
            !p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("quantizers")
        })
        .collect();
    v.sort();
    v
}

/// First index where two slices differ bitwise (f32 compared by bits).
pub fn first_diff<T: PartialEq + Copy>(a: &[T], b: &[T]) -> Option<usize> {
    if a.len() != b.len() {
        return Some(a.len().min(b.len()));
    }
    a.iter().zip(b).position(|(x, y)| x != y)
}

/// f32 slice as bit patterns.
pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// proptest config with `cases` by default, or `$PROPTEST_CASES` for heavier sweeps.
pub fn config(cases: u32) -> proptest::test_runner::Config {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(cases);
    proptest::test_runner::Config {
        cases,
        ..proptest::test_runner::Config::default()
    }
}

/// Every paged-key golden file (`tests/golden/paged/`, SPEC 10), sorted.
pub fn paged_golden_files() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(golden_dir().join("paged"))
        .expect("golden directory tests/golden/paged")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    v.sort();
    v
}
