//! Regression tests for what the fuzz targets (`fuzz/`) found. Each test names its
//! target and the artifact's input in words; `fuzz/FINDINGS.md` has the runs.

use dsa_indexer::batch::Batch;
use dsa_indexer::problem::{Inputs, Keys, Params, Problem, Queries, Role};
use dsa_indexer::reference;
use ndarray::{Array1, Array2, Array3};

/// batch_layout: a tail near `usize::MAX` overflowed `p + tail` in `publishes`
/// (a panic with overflow checks, a wrong row set without). Every row publishes.
#[test]
fn huge_tail_publishes_every_row() {
    let b = Batch::contiguous(&[5, 3], &[1, 0], 1).unwrap();
    for tail in [usize::MAX, usize::MAX - 1, 1 << 63] {
        let t = b.tail(tail).unwrap();
        assert_eq!(t.rows(), b.rows(), "tail {tail}");
        assert_eq!(t.query_starts(), Some(&[1usize, 0][..]));
    }
    // And through a source layer: every row publishes, nothing panics.
    let (rows, keys, h, d) = (b.num_rows(), b.num_keys(), 8, 32);
    let q = Array3::from_elem((rows, h, d), 0x38u8);
    let k = Array2::from_elem((keys, d), 0x38u8);
    let ks = Array1::from_elem(keys, 1.0f32);
    let w = Array2::from_elem((rows, h), 1.0f32);
    let inputs = Inputs {
        q: Queries::E4m3(q.view()),
        k: Keys::E4m3 {
            codes: k.view(),
            scale: ks.view(),
        },
        weights: w.view(),
        k_slots: None,
    };
    let p = Problem::new(
        &b,
        inputs,
        Params::new(2),
        Role::Source {
            tail: Some(usize::MAX),
        },
    )
    .unwrap();
    let out = reference::run(&p);
    assert_eq!(out.published.unwrap().rows.len(), rows);
    let (chunked, _) = dsa_indexer::indexer::run_cpu(&p, 16).unwrap();
    assert_eq!(chunked.raw, out.raw);
}
