//! Regression tests for what the fuzz targets (`fuzz/`) found. Each test names its
//! target and the artifact's input in words; `fuzz/FINDINGS.md` has the runs.

mod common;

use dsa_indexer::batch::Batch;
use dsa_indexer::dump::{Dump, Layout};
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

/// dump_parse (artifact `oom-005440bc...`, a mutated `consumer_fullsize`): `seq_lens`
/// `[771374793]` with `query_starts` `[253951097]` made `Dump::batch` materialise
/// 517M rows (16 GiB) before `q`'s 3 rows were compared. Now a typed error, at once.
#[test]
fn dump_with_huge_seq_lens_is_an_error_not_an_allocation() {
    let path = common::golden_dir().join("consumer.safetensors");
    let mut dump = Dump::from_bytes(&std::fs::read(&path).unwrap()).unwrap();
    assert!(dump.batch().is_ok());
    dump.seq_lens = vec![771_374_793];
    dump.layout = Layout::Contiguous(vec![253_951_097]);
    let bytes = dump.to_bytes().unwrap();
    let dump = Dump::from_bytes(&bytes).unwrap();
    match dump.batch() {
        Err(dsa_indexer::Error::Dump { tensor, .. }) => assert_eq!(tensor, "query_starts"),
        other => panic!("expected a dump error on query_starts, got {other:?}"),
    }
    // Row counts that overflow usize are the same error.
    let mut d = dump.clone();
    d.seq_lens = vec![usize::MAX, usize::MAX];
    d.layout = Layout::Contiguous(vec![0, 0]);
    assert!(matches!(d.batch(), Err(dsa_indexer::Error::Dump { .. })));
}
