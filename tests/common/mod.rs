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

/// Panics naming `file`, `tensor` and the first index where `got` and `want` differ.
pub fn check<T: PartialEq + Copy + std::fmt::Debug>(
    file: &str,
    tensor: &str,
    got: &[T],
    want: &[T],
) {
    if let Some(i) = first_diff(got, want) {
        panic!(
            "{file}: {tensor} differs first at flat index {i}: got {:?}, expected {:?} (lengths {} and {})",
            got.get(i),
            want.get(i),
            got.len(),
            want.len()
        );
    }
}

/// A run's `raw`, `page` and published blocks (with the published rows of `p`) against a
/// golden file's expected tensors, bitwise.
pub fn check_expected_outputs(
    name: &str,
    p: &dsa_indexer::problem::Problem,
    out: &dsa_indexer::reference::Output,
    e: &dsa_indexer::dump::Expected,
) {
    let raw = e.raw.as_ref().expect("expected_raw");
    assert_eq!(out.raw.shape(), raw.shape(), "{name}: raw shape");
    check(
        name,
        "raw",
        out.raw.as_slice().unwrap(),
        raw.as_slice().unwrap(),
    );
    let page = e.page.as_ref().expect("expected_page");
    assert_eq!(out.page.shape(), page.shape(), "{name}: page shape");
    check(
        name,
        "page",
        out.page.as_slice().unwrap(),
        page.as_slice().unwrap(),
    );
    match (&out.published, &e.published) {
        (Some(got), Some(want)) => {
            assert_eq!(got.blocks.shape(), want.shape(), "{name}: published shape");
            check(
                name,
                "published",
                got.blocks.as_slice().unwrap(),
                want.as_slice().unwrap(),
            );
            let rows: Vec<i32> = (0..p.batch.num_rows())
                .filter(|&i| p.publishes(i))
                .map(|i| i as i32)
                .collect();
            check(
                name,
                "published_rows",
                &rows,
                e.published_rows.as_ref().expect("expected_published_rows"),
            );
        }
        (None, None) => {}
        (g, w) => panic!(
            "{name}: published present in output {} / expected {}",
            g.is_some(),
            w.is_some()
        ),
    }
}
