//! SPEC 9's verdict on a dump written by a real fp8 tensor-core engine: DeepGEMM's
//! `fp8_fp4_mqa_logits` and `torch.topk` on an H200, the V3.2 shape (H = 64, D = 128,
//! K = 2048, E4M3 both sides), the last 32 rows of a 4096-token request, with the
//! engine's logits (`tests/fixtures/deepgemm_v32.safetensors`, written by
//! `tests/fixtures/write_deepgemm_dump.py`; its printed figures in `deepgemm_v32.json`).
//!
//! Mutations: one selected key swapped for the key ranked 100 below the `K`-th, and one
//! swap of exactly tied keys, each with and without `engine_logits`.

use std::sync::OnceLock;

use dsa_indexer::dump::Dump;
use dsa_indexer::indexer;
use dsa_indexer::reference::{self, rank_key};
use dsa_indexer::verdict::{
    bound, judge, Options, Status, Tolerance, Verdict, DEFAULT_TOLERANCE_LOG2,
};

fn fixture() -> &'static Dump {
    static D: OnceLock<Dump> = OnceLock::new();
    D.get_or_init(|| {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/deepgemm_v32.safetensors"
        );
        Dump::from_bytes(&std::fs::read(path).expect("the fixture")).expect("a valid dump")
    })
}

/// The fixture's figures as the script printed them.
fn figures() -> serde_json::Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/deepgemm_v32.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The verdict on `d` (replayed through the chunked CPU driver) under `tolerance`.
fn verdict(d: &Dump, tolerance: Tolerance) -> Verdict {
    let batch = d.batch().unwrap();
    let p = d.problem(&batch, None).unwrap();
    let (out, _) = indexer::run_cpu(&p, 64 << 20).unwrap();
    let opts = Options {
        tolerance,
        ..Options::default()
    };
    judge(&p, &out, &d.expected, d.engine_logits.as_ref(), &opts).unwrap()
}

/// Rows 0, 1 and 3 of the fixture (their engine selections are the reference's), for
/// the mutations.
fn three_rows() -> Dump {
    let d = fixture();
    d.select_rows(&d.batch().unwrap(), &[0, 1, 3]).unwrap()
}

/// Row `i`'s reference scores, keys best first, and `M_i`.
fn row_facts(d: &Dump, i: usize) -> (Vec<f32>, Vec<usize>, f64) {
    let batch = d.batch().unwrap();
    let p = d.problem(&batch, None).unwrap();
    let n = batch.rows()[i].n;
    let mut s = vec![0f32; n];
    reference::row_logits(&p, i, &mut s);
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| rank_key(s[b]).cmp(&rank_key(s[a])).then(a.cmp(&b)));
    (s, order, bound::row_magnitude(&p, i))
}

/// In expected `raw` and `page` (identity slots, one request) of row `i`, key `x` by `y`.
fn replace(d: &mut Dump, i: usize, x: usize, y: usize) {
    let raw = d.expected.raw.as_mut().unwrap();
    let page = d.expected.page.as_mut().unwrap();
    for a in [raw, page] {
        let c = a
            .row(i)
            .iter()
            .position(|&v| v == x as i32)
            .expect("x is selected");
        a[[i, c]] = y as i32;
    }
}

fn status(v: &Verdict, part: &str) -> Status {
    v.tensor(part).unwrap_or_else(|| panic!("no {part}")).status
}

#[test]
fn the_unmodified_dump_is_equal_within_tolerance_in_both_modes() {
    let d = fixture();
    let v = verdict(d, Tolerance::Auto);
    assert_eq!(v.status, Status::Tolerant, "{v:#?}");
    assert_eq!(v.tolerance.source, "measured");
    assert_eq!(status(&v, "engine_topk"), Status::Identical);
    let el = v.tensor("engine_logits").unwrap();
    assert_eq!(el.status, Status::Tolerant);
    // The worst |x - ref| / M per (row, key), as the script measured it in float64.
    let want = figures()["max_err_over_M_log2"].as_f64().unwrap();
    let got = el.worst_error_log2.unwrap();
    assert!(
        (got - want).abs() < 0.01,
        "worst error 2^{got} M, script 2^{want} M"
    );
    let raw = v.tensor("raw").unwrap();
    let differ = figures()["rows_whose_selection_differs_from_the_f64_reference"]
        .as_u64()
        .unwrap() as usize;
    assert_eq!(
        (raw.rows_tolerant, raw.rows_ties, raw.rows_different),
        (differ, 0, 0)
    );
    assert_eq!(raw.margins.len(), differ);

    // Without engine_logits: the default tolerance, and the same rows within it.
    let mut sel = d.clone();
    sel.engine_logits = None;
    let v = verdict(&sel, Tolerance::Auto);
    assert_eq!(v.status, Status::Tolerant, "{v:#?}");
    assert_eq!(v.tolerance.source, "default");
    assert_eq!(v.tolerance.log2, Some(DEFAULT_TOLERANCE_LOG2));
    let raw = v.tensor("raw").unwrap();
    assert_eq!((raw.rows_tolerant, raw.rows_different), (differ, 0));
    let m = raw.margin_summary.unwrap();
    assert_eq!(m.beyond_default, 0, "{m:?}");
    assert!(
        m.worst_log2.unwrap() < DEFAULT_TOLERANCE_LOG2 - 2.0,
        "{m:?}"
    );
}

#[test]
fn a_key_ranked_100_below_the_kth_is_different_in_both_modes_with_its_margin() {
    let mut d = three_rows();
    let i = 0;
    let k = d.meta.topk;
    let (s, order, m) = row_facts(&d, i);
    let (x, y) = (order[k - 1], order[k - 1 + 100]);
    replace(&mut d, i, x, y);
    let gap_log2 = ((s[x] as f64 - s[y] as f64) / m).log2();
    let fig = &figures()["gap_rank100_over_rowmaxM_log2 [min, median, max over 32 rows]"];
    let (lo, hi) = (fig[0].as_f64().unwrap(), fig[2].as_f64().unwrap());
    assert!(
        (lo - 0.01..=hi + 0.01).contains(&gap_log2),
        "gap 2^{gap_log2} M outside the script's [2^{lo}, 2^{hi}]"
    );
    assert!(gap_log2 > DEFAULT_TOLERANCE_LOG2 + 1.0, "2^{gap_log2}");

    // With engine_logits: the engine's own logits rank y below x too (the exact top-k
    // check), and the measured error does not explain the gap.
    let v = verdict(&d, Tolerance::Auto);
    assert_eq!(v.status, Status::Different);
    assert_eq!(status(&v, "engine_topk"), Status::Different);
    let raw = v.tensor("raw").unwrap();
    assert_eq!(raw.status, Status::Different);
    assert_eq!(raw.first_different_row, Some(0));
    let margin = raw.margins.iter().find(|r| r.row == 0).unwrap();
    let needs = margin.needs_log2.unwrap();
    assert!(
        (needs - gap_log2).abs() < 1e-9,
        "needs 2^{needs} M, gap 2^{gap_log2} M"
    );
    assert!(
        raw.notes[0].contains(&format!("needs 2^{needs:.1} M")),
        "{:?}",
        raw.notes
    );

    // Without them: the default tolerance catches it.
    d.engine_logits = None;
    let v = verdict(&d, Tolerance::Auto);
    assert_eq!(v.status, Status::Different);
    let raw = v.tensor("raw").unwrap();
    assert_eq!(raw.rows_different, 1);
    let summary = raw.margin_summary.unwrap();
    assert_eq!(summary.worst_row, Some(0));
    assert_eq!(summary.beyond_default, 1);
    assert!((summary.worst_log2.unwrap() - gap_log2).abs() < 1e-9);
    // A tolerance looser than the gap passes it.
    let loose = Tolerance::pow2(gap_log2.ceil()).unwrap();
    assert_eq!(verdict(&d, loose).status, Status::Tolerant);
}

#[test]
fn a_swap_of_exactly_tied_keys_is_equal_up_to_ties() {
    // Row 1 alone: the copied key below changes every row's score of that key.
    let f = fixture();
    let mut d = f.select_rows(&f.batch().unwrap(), &[1]).unwrap();
    let i = 0;
    let k = d.meta.topk;
    let (_, order, _) = row_facts(&d, i);
    // Key b becomes an exact copy of the K-th key a: both score the same, on the
    // reference and on the engine, which computes the same key the same way.
    let (a, b) = (order[k - 1], order[k]);
    match &mut d.k {
        dsa_indexer::dump::KData::E4m3 { codes, scale } => {
            let row = codes.row(a).to_owned();
            codes.row_mut(b).assign(&row);
            scale[b] = scale[a];
        }
        _ => panic!("the fixture has fp8 keys"),
    }
    let el = d.engine_logits.as_mut().unwrap();
    el[[i, b]] = el[[i, a]];
    let (s, _, _) = row_facts(&d, i);
    assert_eq!(s[a].to_bits(), s[b].to_bits(), "keys {a} and {b} tie");
    replace(&mut d, i, a, b);

    let v = verdict(&d, Tolerance::Auto);
    assert_eq!(status(&v, "raw"), Status::Ties, "{:?}", v.tensor("raw"));
    assert_eq!(status(&v, "engine_topk"), Status::Ties);
    // The engine's logits are not the reference's bits: that part alone is within
    // tolerance.
    assert_eq!(status(&v, "engine_logits"), Status::Tolerant);

    d.engine_logits = None;
    for t in [Tolerance::Auto, Tolerance::Ties] {
        let v = verdict(&d, t);
        assert_eq!(v.status, Status::Ties, "{t}: {:?}", v.tensor("raw"));
        assert_eq!(v.status.exit_code(), 0);
    }
}

/// The measured figures behind the default tolerance (`docs/numerics.md`, section 7):
/// each row's largest `|x - ref|` over its visible keys, over the row's `M`.
#[test]
fn deepgemm_row_errors_leave_the_default_its_margin() {
    let d = fixture();
    let batch = d.batch().unwrap();
    let p = d.problem(&batch, None).unwrap();
    let el = d.engine_logits.as_ref().unwrap();
    let mut worst = f64::NEG_INFINITY;
    for (i, r) in batch.rows().iter().enumerate() {
        let mut s = vec![0f32; r.n];
        reference::row_logits(&p, i, &mut s);
        let e = (0..r.n)
            .map(|j| (el[[i, r.ks + j]] as f64 - s[j] as f64).abs())
            .fold(0.0, f64::max);
        worst = worst.max((e / bound::row_magnitude(&p, i)).log2());
    }
    eprintln!("DeepGEMM: max_i max_j |x - ref| / M_i = 2^{worst:.2}");
    // Two scores move: an honest swap needs at most twice that. The default leaves a
    // factor of 2 (to one decimal of the exponent) over it, 4 over one score's error.
    assert!(
        DEFAULT_TOLERANCE_LOG2 - (worst + 1.0) >= 0.95,
        "2^{worst} M"
    );
    // And below the gap of a key ranked 100 below the K-th.
    let fig = &figures()["gap_rank100_over_rowmaxM_log2 [min, median, max over 32 rows]"];
    assert!(DEFAULT_TOLERANCE_LOG2 < fig[0].as_f64().unwrap() - 1.0);
}
