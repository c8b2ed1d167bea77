//! The `verdict` target's case and its model of SPEC 9's verdict, written here from the
//! SPEC's words and independent of `dsa_indexer::verdict`: a small engine dump (one
//! request, its last rows), the engine's logits as the reference's scores moved by a
//! chosen error, its selections SPEC 5's selection of those logits, then mutated
//! (keys swapped, ids reordered or padded elsewhere, malformed ids, logits moved
//! further); with or without `engine_logits`, under each tolerance.
//!
//! The model, for each part:
//! - `engine_logits`: an element is within the class's bound when `|x - ref|` (0 for
//!   the same value as SPEC 5 ranks it) is 0 in the exact class, at most
//!   `2^-8 M_j + 2^-149 (kscale_j (G sum|w| + H) + 2)` in the tolerance class;
//! - `engine_topk`: the expected row against a full sort of the engine's logits, with
//!   no tolerance;
//! - `raw`: against a full sort of the reference's scores, with the row tolerance
//!   `2 max_j |x_j - ref_j|` (engine logits, `auto`), `2^x M_i` (given, or the
//!   tolerance class's default `2^-13`), or 0 (exact ties: `0`, the exact class's
//!   default); `M_i = max_j M_j` over the row's visible keys.
//!
//! A row bitwise the rule's output is identical; the same ids otherwise placed, or a
//! selection whose every key lies on the right side of the `K`-th score, equal up to
//! ties; one whose largest gap to the wrong side is at most the tolerance, equal within
//! tolerance; a wrong count, a non-candidate, a malformed row or a larger gap,
//! different.

use arbitrary::Arbitrary;
use ndarray::{Array1, Array2, Array3};

use dsa_indexer::batch::Batch;
use dsa_indexer::dump::Expected;
use dsa_indexer::problem::{Inputs, Keys, Params, Problem, Queries, Role};
use dsa_indexer::reference;
use dsa_indexer::verdict::{self, Options, Status, Tolerance, Verdict};

use crate::case::magnitude;
use crate::Rng;

/// The fuzzer's view of one engine dump.
#[derive(Arbitrary, Debug, Clone, Default)]
pub struct VerdictCase {
    /// Bit 0: E2M1 queries; bit 1: E2M1 keys (both: the exact class).
    pub formats: u8,
    /// `H = 8 << (heads % 2)`.
    pub heads: u8,
    /// `S = 1 + seq % 40` tokens.
    pub seq: u8,
    /// The last `1 + rows % min(S, 4)` positions are the rows.
    pub rows: u8,
    /// `K = 1 + topk % 20`.
    pub topk: u8,
    /// Code bytes from the first `palette.0 % 9` entries (every byte when 0): small
    /// palettes give exact ties.
    pub palette: (u8, [u8; 8]),
    /// Fills the tensors.
    pub seed: u64,
    /// `% 3`: 0 without `engine_logits`; 1 and 2 with them.
    pub engine: u8,
    /// The engine's error: 0 none; else each logit moves by up to
    /// `2^-(4 + err % 24) * M_j` (a few not at all).
    pub err: u8,
    /// `% 4`: 0, 1 `auto`; 2 exact ties; 3 `2^-(tol_exp % 24) M`.
    pub tolerance: u8,
    /// The exponent of a given tolerance.
    pub tol_exp: u8,
    /// `(row, kind, a, b)`: see [`VerdictCase::mutate`].
    pub mutations: Vec<(u8, u8, u8, u8)>,
}

/// One built case: the problem's tensors, the dump's expected `raw`, the engine's
/// logits and the tolerance to judge with.
pub struct Built {
    batch: Batch,
    q: Array3<u8>,
    q_scale: Option<Array3<u8>>,
    k: Array2<u8>,
    k_scale: Option<Array2<u8>>,
    kscale: Option<Array1<f32>>,
    w: Array2<f32>,
    topk: usize,
    /// The dump's `expected_raw [T, K]`.
    pub raw: Array2<i32>,
    /// `[T, L]`, NaN outside each row's keys.
    pub engine_logits: Option<Array2<f32>>,
    /// The judge's tolerance.
    pub tolerance: Tolerance,
}

impl Built {
    /// The validated problem.
    pub fn problem(&self) -> Problem<'_> {
        let q = match &self.q_scale {
            Some(s) => Queries::E2m1 {
                packed: self.q.view(),
                scale: s.view(),
            },
            None => Queries::E4m3(self.q.view()),
        };
        let k = match (&self.k_scale, &self.kscale) {
            (Some(s), _) => Keys::E2m1 {
                packed: self.k.view(),
                scale: s.view(),
            },
            (None, Some(s)) => Keys::E4m3 {
                codes: self.k.view(),
                scale: s.view(),
            },
            (None, None) => unreachable!("E4M3 keys have scales"),
        };
        let inputs = Inputs {
            q,
            k,
            weights: self.w.view(),
            k_slots: None,
        };
        Problem::new(&self.batch, inputs, Params::new(self.topk), Role::Plain)
            .expect("a verdict case is a valid problem")
    }
}

/// SPEC 5's ranking key as a number: NaN is -inf, -0.0 is +0.0.
fn key(x: f32) -> f64 {
    if x.is_nan() {
        f64::NEG_INFINITY
    } else if x == 0.0 {
        0.0
    } else {
        x as f64
    }
}

/// The row's keys `0..n` best first (key descending, then index ascending).
fn ranked(s: &[f32]) -> Vec<usize> {
    let mut o: Vec<usize> = (0..s.len()).collect();
    o.sort_by(|&a, &b| key(s[b]).total_cmp(&key(s[a])).then(a.cmp(&b)));
    o
}

/// SPEC 5's output row: the best `K` ids ascending, `-1`-padded to `K`.
fn spec5_row(s: &[f32], k: usize) -> Vec<i32> {
    let mut ids: Vec<i32> = ranked(s).into_iter().take(k).map(|j| j as i32).collect();
    ids.sort_unstable();
    ids.resize(k, -1);
    ids
}

impl VerdictCase {
    /// The dump this case describes.
    pub fn build(&self) -> Built {
        let mut rng = Rng(self.seed);
        let (q_fp4, k_fp4) = (self.formats & 1 == 1, self.formats & 2 == 2);
        let h = 8usize << (self.heads % 2);
        let d = 32usize;
        let s = 1 + self.seq as usize % 40;
        let e = 1 + self.rows as usize % s.min(4);
        let topk = 1 + self.topk as usize % 20;
        let batch = Batch::contiguous(&[s], &[s - e], 1).expect("a valid batch");
        let pal: Vec<u8> = self.palette.1[..self.palette.0 as usize % 9].to_vec();
        let code = |rng: &mut Rng, fp4: bool| {
            let b = rng.pick(&pal, |r| r.next() as u8);
            if !fp4 && b & 0x7F == 0x7F {
                b ^ 1
            } else {
                b
            }
        };
        let q = Array3::from_shape_simple_fn((e, h, if q_fp4 { d / 2 } else { d }), || {
            code(&mut rng, q_fp4)
        });
        let k = Array2::from_shape_simple_fn((s, if k_fp4 { d / 2 } else { d }), || {
            code(&mut rng, k_fp4)
        });
        let q_scale =
            q_fp4.then(|| Array3::from_shape_simple_fn((e, h, 1), || 125 + rng.below(5) as u8));
        let k_scale =
            k_fp4.then(|| Array2::from_shape_simple_fn((s, 1), || 125 + rng.below(5) as u8));
        let kscale =
            (!k_fp4).then(|| Array1::from_shape_simple_fn(s, || (1 + rng.below(4)) as f32 * 0.5));
        let w = Array2::from_shape_simple_fn((e, h), || (rng.below(17) as f32 - 8.0) * 0.25);
        let mut b = Built {
            batch,
            q,
            q_scale,
            k,
            k_scale,
            kscale,
            w,
            topk,
            raw: Array2::from_elem((e, topk), -1),
            engine_logits: None,
            tolerance: match self.tolerance % 4 {
                2 => Tolerance::Ties,
                3 => Tolerance::Pow2(-((self.tol_exp % 24) as f64)),
                _ => Tolerance::Auto,
            },
        };
        // The engine's logits: the reference's scores, each moved by its error.
        let (l, mut logits) = {
            let p = b.problem();
            let l = p.batch.num_keys();
            let mut m = Array2::from_elem((e, l), f32::NAN);
            for i in 0..e {
                let n = p.batch.rows()[i].n;
                let mut r = vec![0f32; n];
                reference::row_logits(&p, i, &mut r);
                for j in 0..n {
                    let x = if self.err == 0 || rng.below(4) == 0 {
                        r[j]
                    } else {
                        let scale = (-(4.0 + (self.err % 24) as f64)).exp2() * magnitude(&p, i, j);
                        let u = (rng.below(1 << 20) as f64 / (1 << 20) as f64) * 2.0 - 1.0;
                        (r[j] as f64 + u * scale) as f32
                    };
                    m[[i, j]] = x;
                }
            }
            (l, m)
        };
        debug_assert_eq!(l, s);
        // Its selections: SPEC 5 on its own logits, then the mutations.
        let mut raw = Array2::from_elem((e, topk), -1i32);
        for i in 0..e {
            let n = b.batch.rows()[i].n;
            let s: Vec<f32> = logits.row(i).iter().take(n).copied().collect();
            let row = spec5_row(&s, topk);
            raw.row_mut(i).assign(&Array1::from(row));
        }
        for &(r, kind, a, c) in self.mutations.iter().take(4) {
            let i = r as usize % e;
            let n = b.batch.rows()[i].n;
            mutate(
                &mut raw,
                &mut logits,
                i,
                n,
                kind,
                a,
                c,
                &mut rng,
                &b.problem(),
            );
        }
        b.raw = raw;
        b.engine_logits = (!self.engine.is_multiple_of(3)).then_some(logits);
        b
    }
}

/// One mutation of row `i` (`n` visible keys) by `kind % 6`: swap a selected key for a
/// left-out one (chosen by `a`, `c`), swap the selected key ranked `K`-th for the one
/// ranked `K + 1 + c % 4`-th by the engine's own logits (near-ties), reorder the row's
/// ids and move its padding, write a malformed id, or move one logit further by up to
/// `2^-(a % 16) M_j` (the selection stays).
#[allow(clippy::too_many_arguments)]
fn mutate(
    raw: &mut Array2<i32>,
    logits: &mut Array2<f32>,
    i: usize,
    n: usize,
    kind: u8,
    a: u8,
    c: u8,
    rng: &mut Rng,
    p: &Problem,
) {
    let row: Vec<i32> = raw.row(i).to_vec();
    let sel: Vec<i32> = row.iter().copied().filter(|&x| x >= 0).collect();
    let unsel: Vec<i32> = (0..n as i32).filter(|j| !sel.contains(j)).collect();
    let mut new = row.clone();
    match kind % 6 {
        0 if !sel.is_empty() && !unsel.is_empty() => {
            let x = sel[a as usize % sel.len()];
            let y = unsel[c as usize % unsel.len()];
            new.iter_mut().filter(|v| **v == x).for_each(|v| *v = y);
        }
        1 if !sel.is_empty() && !unsel.is_empty() => {
            let s: Vec<f32> = logits.row(i).iter().take(n).copied().collect();
            let o = ranked(&s);
            // Earlier mutations may have left ids past `n`, or fewer ids.
            let k = sel.len().clamp(1, n);
            let (x, y) = (o[k - 1] as i32, o[(k + c as usize % 4).min(n - 1)] as i32);
            new.iter_mut().filter(|v| **v == x).for_each(|v| *v = y);
        }
        2 => {
            let len = new.len().max(1);
            new.rotate_left(a as usize % len);
            if c % 2 == 1 {
                new.reverse();
            }
        }
        3 => {
            let col = a as usize % new.len();
            new[col] = match c % 4 {
                0 => -2,
                1 => (n + c as usize % 3) as i32,
                2 => *sel.first().unwrap_or(&0),
                _ => -1,
            };
        }
        4 => {
            let j = c as usize % n.max(1);
            if n > 0 {
                let m = magnitude(p, i, j);
                let u = rng.below(1024) as f64 / 1024.0;
                let x = logits[[i, j]] as f64 + u * (-((a % 16) as f64)).exp2() * m;
                logits[[i, j]] = x as f32;
            }
        }
        _ => {}
    }
    raw.row_mut(i).assign(&Array1::from(new));
}

/// `|x - ref|`: 0 for equal values (either zero, the same infinity) and for NaN on both
/// sides, infinite for a non-finite value against anything else.
fn err(x: f32, r: f32) -> f64 {
    if x == r || (x.is_nan() && r.is_nan()) {
        0.0
    } else if x.is_finite() && r.is_finite() {
        (x as f64 - r as f64).abs()
    } else {
        f64::INFINITY
    }
}

/// The model's judgement of one selection row.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ModelRow {
    /// Its status.
    pub status: Status,
    /// The gap it needs (`None`: no tolerance passes it).
    pub need: Option<f64>,
    /// The tolerance it was judged with.
    pub tau: f64,
}

/// An expected row against SPEC 5's rule on scores `s` (the rule's own output `own`),
/// with tolerance `tau`.
fn model_row(exp: &[i32], own: &[i32], s: &[f32], k: usize, tau: f64) -> ModelRow {
    let r = |status, need| ModelRow { status, need, tau };
    if exp == own {
        return r(Status::Identical, Some(0.0));
    }
    if exp.iter().any(|&x| x < -1) {
        return r(Status::Different, None);
    }
    let mut ids: Vec<usize> = exp
        .iter()
        .filter(|&&x| x >= 0)
        .map(|&x| x as usize)
        .collect();
    ids.sort_unstable();
    if ids.windows(2).any(|w| w[0] == w[1]) {
        return r(Status::Different, None);
    }
    let n = s.len();
    let mut o: Vec<usize> = own
        .iter()
        .filter(|&&x| x >= 0)
        .map(|&x| x as usize)
        .collect();
    o.sort_unstable();
    if ids == o {
        return r(Status::Ties, Some(0.0));
    }
    if ids.len() != n.min(k) || ids.iter().any(|&j| j >= n) {
        return r(Status::Different, None);
    }
    let order = ranked(s);
    let kth = key(s[order[k - 1]]);
    let mut need = 0f64;
    for (j, &sj) in s.iter().enumerate() {
        let v = key(sj);
        let gap = if ids.binary_search(&j).is_ok() {
            kth - v
        } else {
            v - kth
        };
        if gap > 0.0 {
            need = need.max(gap);
        }
    }
    let status = if need == 0.0 {
        Status::Ties
    } else if need <= tau {
        Status::Tolerant
    } else {
        Status::Different
    };
    r(status, Some(need))
}

/// Check the library's verdict on `b` against the model. Panics on a disagreement.
pub fn check(b: &Built) -> Verdict {
    let p = b.problem();
    let out = reference::run(&p);
    let expected = Expected {
        raw: Some(b.raw.clone()),
        ..Default::default()
    };
    let opts = Options {
        tolerance: b.tolerance,
        ..Options::default()
    };
    let v = verdict::judge(&p, &out, &expected, b.engine_logits.as_ref(), &opts)
        .expect("the judge accepts a well-shaped dump");
    let exact = q_and_k_fp4(&p);
    let (t, k) = (p.batch.num_rows(), p.topk);
    let (g, h) = ((p.dim / 32) as f64, p.heads as f64);
    let mut worst = Status::NoExpected;
    let mut raw_rows = Vec::new();
    let mut topk_rows = Vec::new();
    let mut logit_rows = Vec::new();
    for i in 0..t {
        let n = p.batch.rows()[i].n;
        let mut r = vec![0f32; n];
        reference::row_logits(&p, i, &mut r);
        let m: Vec<f64> = (0..n).map(|j| magnitude(&p, i, j)).collect();
        let m_row = m.iter().copied().fold(0.0, f64::max);
        let exp: Vec<i32> = b.raw.row(i).to_vec();
        let mut measured = 0f64;
        if let Some(el) = &b.engine_logits {
            let x: Vec<f32> = el.row(i).iter().take(n).copied().collect();
            let sum_w: f64 = (0..p.heads)
                .map(|hh| (p.inputs.weights[[i, hh]] as f64).abs())
                .sum();
            let mut row_status = Status::Identical;
            for j in 0..n {
                let e = err(x[j], r[j]);
                measured = measured.max(e);
                if x[j].to_bits() == r[j].to_bits() {
                    continue;
                }
                let kscale = p.key(&p.batch.rows()[i], j).kscale() as f64;
                let bound = if exact {
                    0.0
                } else {
                    (-8f64).exp2() * m[j] + (-149f64).exp2() * (kscale * (g * sum_w + h) + 2.0)
                };
                let s = if e <= bound {
                    Status::Tolerant
                } else {
                    Status::Different
                };
                if (e - bound).abs() > 1e-9 * bound || exact {
                    row_status = row_status.max(s);
                } else {
                    row_status = row_status.max(Status::Tolerant);
                }
            }
            logit_rows.push(row_status);
            let own = spec5_row(&x, k);
            topk_rows.push(model_row(&exp, &own, &x, k, 0.0));
        }
        let tau = match (b.tolerance, &b.engine_logits) {
            (Tolerance::Ties, _) => 0.0,
            (Tolerance::Pow2(x), _) => x.exp2() * m_row,
            (Tolerance::Auto, Some(_)) => 2.0 * measured,
            (Tolerance::Auto, None) if exact => 0.0,
            (Tolerance::Auto, None) => (-13f64).exp2() * m_row,
        };
        raw_rows.push((
            model_row(&exp, out.raw.row(i).as_slice().unwrap(), &r, k, tau),
            m_row,
        ));
    }
    let raw = v.tensor("raw").expect("a raw part");
    worst = worst.max(compare_part(raw, &raw_rows, "raw"));
    if b.engine_logits.is_some() {
        let el = v.tensor("engine_logits").expect("an engine_logits part");
        let s = logit_rows
            .iter()
            .copied()
            .max()
            .unwrap_or(Status::Identical);
        let lib_bad = el.rows_different;
        let model_bad = logit_rows
            .iter()
            .filter(|&&s| s == Status::Different)
            .count();
        assert_eq!(
            lib_bad, model_bad,
            "engine_logits: different rows ({logit_rows:?}) {el:?}"
        );
        assert_eq!(el.status, s, "engine_logits status: {el:?}");
        worst = worst.max(s);
        let tk = v.tensor("engine_topk").expect("an engine_topk part");
        let rows: Vec<(ModelRow, f64)> = topk_rows
            .iter()
            .zip(&raw_rows)
            .map(|(a, b)| (*a, b.1))
            .collect();
        worst = worst.max(compare_part(tk, &rows, "engine_topk"));
    } else {
        assert!(v.tensor("engine_topk").is_none() && v.tensor("engine_logits").is_none());
    }
    assert_eq!(v.status, worst, "overall verdict: {v:?}");
    v
}

/// Whether both sides are E2M1 (the exact class), decided from the inputs.
fn q_and_k_fp4(p: &Problem) -> bool {
    let k_fp4 = match p.inputs.k {
        Keys::E2m1 { .. } => true,
        Keys::Paged(pk) => pk.format == dsa_indexer::problem::Format::E2m1,
        Keys::E4m3 { .. } => false,
    };
    matches!(p.inputs.q, Queries::E2m1 { .. }) && k_fp4
}

/// One selection part against the model's rows (with each row's `M`); the part's status.
fn compare_part(t: &verdict::TensorVerdict, rows: &[(ModelRow, f64)], name: &str) -> Status {
    let mut status = Status::Identical;
    let (mut ties, mut tol, mut bad) = (0, 0, 0);
    let mut boundary = 0;
    for (i, (r, m)) in rows.iter().enumerate() {
        let near = r
            .need
            .is_some_and(|n| n > 0.0 && (n - r.tau).abs() <= 1e-9 * r.tau);
        let lib = t.margins.iter().find(|x| x.row == i);
        match r.status {
            Status::Identical => assert!(lib.is_none(), "{name} row {i}: identical, {lib:?}"),
            s => {
                let lib =
                    lib.unwrap_or_else(|| panic!("{name} row {i}: {r:?} has no margin: {t:?}"));
                if near {
                    boundary += 1;
                    assert!(
                        matches!(lib.status, Status::Tolerant | Status::Different),
                        "{name} row {i}: {r:?} vs {lib:?}"
                    );
                } else {
                    assert_eq!(lib.status, s, "{name} row {i}: model {r:?}, judge {lib:?}");
                }
                match (r.need, lib.needs_log2) {
                    (Some(n), Some(x)) if n > 0.0 => {
                        let want = (n / m).log2();
                        assert!(
                            (x - want).abs() <= 1e-9 * want.abs().max(1.0),
                            "{name} row {i}: margin 2^{x} M, model 2^{want} M"
                        );
                    }
                    (Some(n), None) if n > 0.0 => {
                        assert!(
                            !(n / m).log2().is_finite(),
                            "{name} row {i}: no margin for {r:?}"
                        )
                    }
                    (None, Some(x)) => panic!("{name} row {i}: margin 2^{x} for an unfixable row"),
                    _ => {}
                }
                match lib.status {
                    Status::Ties => ties += 1,
                    Status::Tolerant => tol += 1,
                    _ => bad += 1,
                }
                status = status.max(lib.status);
            }
        }
    }
    assert_eq!(
        (t.rows_ties, t.rows_tolerant, t.rows_different),
        (ties, tol, bad),
        "{name}: row counts ({boundary} at the boundary)"
    );
    assert_eq!(t.status, status, "{name}: status");
    status
}
