//! SPEC 3: batch layout.

use dsa_indexer::batch::Batch;
use dsa_indexer::Error;

fn ks_ke(b: &Batch) -> (Vec<usize>, Vec<usize>) {
    (
        b.rows().iter().map(|r| r.ks).collect(),
        b.rows().iter().map(|r| r.ke()).collect(),
    )
}

#[test]
fn worked_examples_of_the_spec() {
    let b = Batch::contiguous(&[10, 4], &[7, 2], 1).unwrap();
    assert_eq!(ks_ke(&b), (vec![0, 0, 0, 10, 10], vec![8, 9, 10, 13, 14]));
    let b = Batch::contiguous(&[10, 4], &[7, 2], 2).unwrap();
    assert_eq!(ks_ke(&b), (vec![0, 0, 0, 5, 5], vec![4, 4, 5, 6, 7]));
    // n = ke - ks: 4, 4, 5, 1, 2.
    assert_eq!(b.longest_row(), 5);
    assert_eq!(Batch::contiguous(&[3], &[3], 1).unwrap().longest_row(), 0);
}

#[test]
fn ratios_prefix_hits_replays_and_empty_requests() {
    // Ratio 4: positions 0..=2 see nothing, 3..=6 see one key.
    let b = Batch::contiguous(&[9], &[0], 4).unwrap();
    let n: Vec<usize> = b.rows().iter().map(|r| r.n).collect();
    assert_eq!(n, vec![0, 0, 0, 1, 1, 1, 1, 2, 2]);
    assert_eq!(b.num_keys(), 2);
    // A request with no rows still owns its keys in the flat buffer.
    let b = Batch::contiguous(&[5, 7, 3], &[5, 6, 0], 1).unwrap();
    assert_eq!(b.num_rows(), 1 + 3);
    assert_eq!(b.requests()[1].key_offset, 5);
    assert_eq!(b.requests()[2].key_offset, 12);
    assert_eq!(b.rows()[0].request, 1);
    assert_eq!(ks_ke(&b), (vec![5, 12, 12, 12], vec![12, 13, 14, 15]));
    // Replay before a prefix hit: rows start below the prefix length; same rule.
    let b = Batch::contiguous(&[100], &[90], 2).unwrap();
    assert_eq!(b.rows()[0].position, 90);
    assert_eq!(b.rows()[0].n, 45);
    // seq_len 0 and ratio larger than seq_len.
    let b = Batch::contiguous(&[0, 1], &[0, 0], 2).unwrap();
    assert_eq!(b.num_rows(), 1);
    assert_eq!(b.rows()[0].n, 0);
    assert_eq!(b.num_keys(), 0);
}

#[test]
fn explicit_rows() {
    let b = Batch::explicit(&[10, 4], &[1, 0, 1, 0], &[3, 9, 0, 0], 1).unwrap();
    assert_eq!(ks_ke(&b), (vec![10, 0, 10, 0], vec![14, 10, 11, 1]));
    assert!(b.query_starts().is_none());
    let e = Batch::explicit(&[10, 4], &[1], &[4], 1).unwrap_err();
    assert!(
        e.to_string().contains("row_positions[0]") && e.to_string().contains('4'),
        "{e}"
    );
    let e = Batch::explicit(&[10], &[2], &[0], 1).unwrap_err();
    assert!(e.to_string().contains("row_requests[0]"), "{e}");
    let e = Batch::explicit(&[10], &[0, 0], &[0], 1).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }), "{e}");
}

#[test]
fn tail_batches() {
    let b = Batch::contiguous(&[10, 4, 6], &[2, 0, 6], 1).unwrap();
    let t = b.tail(3).unwrap();
    assert_eq!(t.query_starts().unwrap(), &[7, 1, 6]);
    let pos: Vec<(usize, usize)> = t.rows().iter().map(|r| (r.request, r.position)).collect();
    assert_eq!(pos, vec![(0, 7), (0, 8), (0, 9), (1, 1), (1, 2), (1, 3)]);
    assert_eq!(t, Batch::contiguous(&[10, 4, 6], &[7, 1, 6], 1).unwrap());
    // A tail longer than a request keeps all its rows.
    assert_eq!(b.tail(100).unwrap().num_rows(), b.num_rows());
    assert!(b.tail(0).unwrap_err().to_string().contains("tail"));
}

#[test]
fn bad_layouts_are_typed_errors() {
    let e = Batch::contiguous(&[4], &[5], 1).unwrap_err();
    assert_eq!(e.to_string(), "query_starts[0] = 5: query_start <= seq_len");
    let e = Batch::contiguous(&[4], &[0], 0).unwrap_err();
    assert!(e.to_string().starts_with("ratio = 0"), "{e}");
    let e = Batch::contiguous(&[4, 5], &[0], 1).unwrap_err();
    assert!(matches!(e, Error::Shape { ref field, .. } if field == "query_starts"));
    // Sizes whose sums overflow usize.
    let e = Batch::contiguous(&[usize::MAX, usize::MAX], &[usize::MAX, usize::MAX], 1).unwrap_err();
    assert!(matches!(e, Error::Overflow { .. }), "{e}");
    let e = Batch::contiguous(&[usize::MAX, 2], &[0, 0], 1).unwrap_err();
    assert!(matches!(e, Error::Overflow { .. }), "{e}");
}
