//! The judge on a small exact-class problem: identical, up to ties, different, errors,
//! the tolerance's parsing, and the text and JSON of one report.

use super::*;
use crate::batch::Batch;
use crate::problem::{Inputs, Keys, Params, Queries};
use crate::reference;
use ndarray::{Array2, Array3};

/// Arbitrary bytes from a fixed sequence (every byte is a valid E2M1 pair).
fn bytes(n: usize, mut x: u64) -> Vec<u8> {
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 56) as u8
        })
        .collect()
}

struct Case {
    batch: Batch,
    q: Array3<u8>,
    qs: Array3<u8>,
    k: Array2<u8>,
    ks: Array2<u8>,
    w: Array2<f32>,
}

/// fp4 x fp4, H = 8, D = 32: one request of 40 keys, its last 8 rows.
fn case() -> Case {
    let batch = Batch::contiguous(&[40], &[32], 1).unwrap();
    let (t, l) = (batch.num_rows(), batch.num_keys());
    Case {
        q: Array3::from_shape_vec((t, 8, 16), bytes(t * 8 * 16, 1)).unwrap(),
        qs: Array3::from_elem((t, 8, 1), 127),
        k: Array2::from_shape_vec((l, 16), bytes(l * 16, 2)).unwrap(),
        ks: Array2::from_elem((l, 1), 127),
        w: Array2::from_shape_fn((t, 8), |(i, h)| (i + 2 * h) as f32 * 0.25 - 1.0),
        batch,
    }
}

fn problem(c: &Case) -> Problem<'_> {
    let inputs = Inputs {
        q: Queries::E2m1 {
            packed: c.q.view(),
            scale: c.qs.view(),
        },
        k: Keys::E2m1 {
            packed: c.k.view(),
            scale: c.ks.view(),
        },
        weights: c.w.view(),
        k_slots: None,
    };
    Problem::new(&c.batch, inputs, Params::new(4), Role::Plain).unwrap()
}

fn expected(p: &Problem, out: &Output) -> Expected {
    Expected {
        ks: Some(p.batch.rows().iter().map(|r| r.ks as i32).collect()),
        ke: Some(p.batch.rows().iter().map(|r| r.ke() as i32).collect()),
        logits: Some(reference::logits(p)),
        raw: Some(out.raw.clone()),
        page: Some(out.page.clone()),
        published: None,
        published_rows: None,
    }
}

#[test]
fn the_reference_judged_against_itself_is_identical() {
    let c = case();
    let p = problem(&c);
    let out = reference::run(&p);
    let v = judge(&p, &out, &expected(&p, &out), None, &Options::default()).unwrap();
    assert_eq!(v.status, Status::Identical);
    let names: Vec<&str> = v.tensors.iter().map(|t| t.name).collect();
    assert_eq!(names, ["ks", "ke", "raw", "page", "logits"]);
    assert_eq!(v.status.exit_code(), 0);
}

#[test]
fn nothing_to_compare_is_no_expected_outputs() {
    let c = case();
    let p = problem(&c);
    let out = reference::run(&p);
    let v = judge(&p, &out, &Expected::default(), None, &Options::default()).unwrap();
    assert_eq!(v.status, Status::NoExpected);
    assert!(v.tensors.is_empty());
}

#[test]
fn a_moved_key_is_different_and_reordered_ids_are_equal_up_to_order() {
    let c = case();
    let p = problem(&c);
    let out = reference::run(&p);
    let i = 5;
    let n = p.batch.rows()[i].n;
    // The key the reference ranks last replaces its K-th selection.
    let scores = bound::row_scores(&p, i);
    let worst = (0..n)
        .min_by_key(|&j| reference::rank_key(scores[j]))
        .unwrap();
    let mut e = expected(&p, &out);
    let raw = e.raw.as_mut().unwrap();
    let last = (0..p.topk).rev().find(|&c| raw[[i, c]] >= 0).unwrap();
    raw[[i, last]] = worst as i32;
    e.page = None;
    let rows: Vec<usize> = (100..100 + p.batch.num_rows()).collect();
    let opts = Options {
        row_numbers: Some(&rows),
        ..Options::default()
    };
    let v = judge(&p, &out, &e, None, &opts).unwrap();
    assert_eq!(v.status, Status::Different);
    let t = v.tensor("raw").unwrap();
    assert_eq!((t.rows_different, t.rows_tolerant), (1, 0));
    assert_eq!(t.first_different_row, Some(105));
    assert!(
        t.notes[0].starts_with("row 105 (request 0"),
        "{:?}",
        t.notes
    );

    let mut e = expected(&p, &out);
    for a in [e.raw.as_mut().unwrap(), e.page.as_mut().unwrap()] {
        let mut r = a.row(i).to_vec();
        r.reverse();
        a.row_mut(i).assign(&ndarray::Array1::from(r));
    }
    let v = judge(&p, &out, &e, None, &Options::default()).unwrap();
    assert_eq!(v.status, Status::Ties);
    assert!(v.tensor("raw").unwrap().notes[0].contains("the same ids"));
    assert_eq!(v.tensor("page").unwrap().rows_ties, 1);
}

#[test]
fn a_logit_off_by_far_more_than_the_bound_is_different() {
    let c = case();
    let p = problem(&c);
    let out = reference::run(&p);
    let mut e = expected(&p, &out);
    let l = e.logits.as_mut().unwrap();
    l[3] += 1e6;
    l[4] = f32::from_bits(l[4].to_bits() ^ 1);
    let v = judge(&p, &out, &e, None, &Options::default()).unwrap();
    let t = v.tensor("logits").unwrap();
    assert_eq!(t.status, Status::Different);
    assert_eq!(t.first_different_row, Some(0));
    assert!(t.notes[0].contains("beyond the bound"), "{:?}", t.notes);
}

#[test]
fn a_misshaped_expected_tensor_is_an_error_naming_it() {
    let c = case();
    let p = problem(&c);
    let out = reference::run(&p);
    let mut e = expected(&p, &out);
    e.ks.as_mut().unwrap().pop();
    let err = judge(&p, &out, &e, None, &Options::default()).unwrap_err();
    assert!(
        matches!(&err, Error::Dump { tensor, .. } if tensor == "expected_ks"),
        "{err}"
    );
    let e = expected(&p, &out);
    let short = [0usize; 3];
    let opts = Options {
        row_numbers: Some(&short),
        ..Options::default()
    };
    assert!(judge(&p, &out, &e, None, &opts).is_err());
}

#[test]
fn the_text_and_the_json_say_the_same() {
    let c = case();
    let p = problem(&c);
    let out = reference::run(&p);
    let mut e = expected(&p, &out);
    e.raw.as_mut().unwrap()[[2, 0]] = -5;
    let v = judge(&p, &out, &e, None, &Options::default()).unwrap();
    let r = ReplayReport {
        file: "case.safetensors".into(),
        partial: false,
        layer: Layer::of(&p),
        device: "cpu".into(),
        device_detail: "cpu".into(),
        budget: 1 << 20,
        seconds: Seconds::default(),
        verdict: v,
    };
    let text = r.to_string();
    let json = serde_json::to_value(&r).unwrap();
    assert_eq!(json["verdict"], "different");
    assert!(text.ends_with("verdict: different\n"), "{text}");
    assert_eq!(json["tensors"]["raw"]["status"], "different");
    assert_eq!(json["tensors"]["raw"]["rows_different"], 1);
    assert!(
        text.contains("  raw            different: 1 of 8 rows differ"),
        "{text}"
    );
    let note = json["tensors"]["raw"]["notes"][0].as_str().unwrap();
    assert!(
        note.contains("malformed expected row: column 0 = -5"),
        "{note}"
    );
    assert!(text.contains(note), "{text}");
    for k in [
        "rows", "keys", "heads", "dim", "topk", "ratio", "class", "role",
    ] {
        assert!(json.get(k).is_some(), "{k}: {json}");
    }
    assert_eq!(r.exit_code(), 1);
}

#[test]
fn tolerances_parse_and_bad_ones_are_errors_naming_the_field() {
    assert_eq!("auto".parse::<Tolerance>().unwrap(), Tolerance::Auto);
    assert_eq!("0".parse::<Tolerance>().unwrap(), Tolerance::Ties);
    assert_eq!(
        "2^-13".parse::<Tolerance>().unwrap(),
        Tolerance::Pow2(-13.0)
    );
    assert_eq!(
        "2^-8.5".parse::<Tolerance>().unwrap(),
        Tolerance::Pow2(-8.5)
    );
    assert_eq!(Tolerance::Pow2(-13.0).to_string(), "2^-13");
    for bad in ["2^1", "2^inf", "2^NaN", "1e-4", "", "2^"] {
        let e = bad.parse::<Tolerance>().unwrap_err();
        assert!(
            matches!(&e, Error::OutOfRange { field, .. } if field == "tolerance"),
            "{bad}: {e}"
        );
    }
}

#[test]
fn an_exact_class_swap_is_different_by_default_and_its_margin_is_reported() {
    let c = case();
    let p = problem(&c);
    let out = reference::run(&p);
    let i = 5;
    let scores = bound::row_scores(&p, i);
    let n = p.batch.rows()[i].n;
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by_key(|&j| (std::cmp::Reverse(reference::rank_key(scores[j])), j));
    let k = p.topk;
    let (x, y) = (order[k - 1], order[k]);
    assert!(scores[x] > scores[y], "a strict gap at the K-th key");
    let mut e = Expected {
        raw: Some(out.raw.clone()),
        ..Default::default()
    };
    let raw = e.raw.as_mut().unwrap();
    let col = raw.row(i).iter().position(|&v| v == x as i32).unwrap();
    raw[[i, col]] = y as i32;
    let v = judge(&p, &out, &e, None, &Options::default()).unwrap();
    assert_eq!(v.status, Status::Different);
    assert_eq!(v.tolerance.rule, "exact ties only");
    let t = v.tensor("raw").unwrap();
    let m = bound::row_magnitude(&p, i);
    let want = ((scores[x] as f64 - scores[y] as f64) / m).log2();
    assert_eq!(t.margins.len(), 1);
    assert!((t.margins[0].needs_log2.unwrap() - want).abs() < 1e-12);
    assert_eq!(t.margin_summary.unwrap().beyond_default, 1);
    // Under a tolerance at least its margin, the same row passes.
    let opts = Options {
        tolerance: Tolerance::pow2(want.ceil().min(0.0)).unwrap(),
        ..Options::default()
    };
    let v = judge(&p, &out, &e, None, &opts).unwrap();
    assert_eq!(v.status, Status::Tolerant);
    assert_eq!(v.tolerance.source, "given");
}
