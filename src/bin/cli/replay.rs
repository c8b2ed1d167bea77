//! `replay`: run a dump (SPEC 9) through the chunked driver and diff the outputs it
//! carries, with SPEC 9's verdict.

use std::collections::HashMap;
use std::io::IsTerminal;
use std::time::Instant;

use dsa_indexer::batch::Batch;
use dsa_indexer::cpu::{Engine, ROW_GROUP};
use dsa_indexer::dump::{Dump, Expected, Layout, QData};
use dsa_indexer::formats::{e2m1, e4m3, ue8m0};
use dsa_indexer::indexer::{self, Backend};
use dsa_indexer::problem::{Keys, Problem, Queries, Role};
use dsa_indexer::reference::{candidates, rank_key, Output};
use ndarray::{Array2, Array3, Axis};
use rayon::prelude::*;
use serde_json::json;

use crate::errors::{CliError, Result};
use crate::{human_bytes, Device};

/// Options of `replay`.
pub struct Opts {
    pub file: std::path::PathBuf,
    pub rows: Option<(usize, usize)>,
    pub request: Option<usize>,
    pub show_row: Option<usize>,
    pub device: Device,
    pub budget: Option<usize>,
    pub json: bool,
    pub max_show: usize,
    pub verbose: bool,
}

/// How one tensor compares.
#[derive(Debug, Default, Clone)]
struct TensorDiff {
    /// Rows (or elements, for `logits`) compared.
    compared: usize,
    /// Differing only within ties / the tolerance bound.
    tolerant: usize,
    /// Really different.
    different: usize,
    /// Notes on the first differing rows.
    notes: Vec<String>,
    /// First different row (original numbering), for tests and scripts.
    first_row: Option<usize>,
}

impl TensorDiff {
    fn status(&self) -> &'static str {
        if self.different > 0 {
            "different"
        } else if self.tolerant > 0 {
            "equal up to ties and tolerance"
        } else {
            "identical"
        }
    }
}

/// Everything the diff needs about a row beyond the problem.
struct Ctx<'a, 'p> {
    p: &'a Problem<'p>,
    /// Original row number of each replayed row.
    orig: &'a [usize],
    max_show: usize,
    verbose: bool,
}

/// Row `i`'s scores over its visible keys, from the fast engine (bitwise the reference).
fn row_scores(p: &Problem, i: usize) -> Vec<f32> {
    let mut v = vec![0f32; p.batch.rows()[i].n];
    let mut e = Engine::new(p);
    e.rows(p, &[i], &mut [&mut v[..]]);
    v
}

/// SPEC 4's magnitude before cancellation `M_j` of row `i` against each visible key,
/// in f64: `kscale_j * sum_h |w_h| * sum_g c_g * sum_{d in g} |q_d k_d|`, with `c_g`
/// the product of the group scales present. Factored as
/// `sum_g c^k_g sum_d |k_d| A[d]`, `A[d] = sum_h |w_h| c^q_{h,g} |q_{h,d}|`.
fn magnitudes(p: &Problem, i: usize) -> Vec<f64> {
    let (h, d) = (p.heads, p.dim);
    let mut a = vec![0f64; d];
    for hh in 0..h {
        let w = (p.inputs.weights[[i, hh]] as f64).abs();
        for (e, ae) in a.iter_mut().enumerate() {
            let (q, c) = match p.inputs.q {
                Queries::E4m3(q) => (e4m3::decode(q[[i, hh, e]]) as f64, 1.0),
                Queries::E2m1 { packed, scale } => {
                    let b = packed[[i, hh, e / 2]];
                    let code = if e % 2 == 0 { b & 0xF } else { b >> 4 };
                    (
                        e2m1::decode(code) as f64,
                        ue8m0::decode(scale[[i, hh, e / 32]]) as f64,
                    )
                }
            };
            *ae += w * c * q.abs();
        }
    }
    let row = p.batch.rows()[i];
    (0..row.n)
        .map(|j| {
            let x = row.ks + j;
            match p.inputs.k {
                Keys::E4m3 { codes, scale } => {
                    let s: f64 = (0..d)
                        .map(|e| (e4m3::decode(codes[[x, e]]) as f64).abs() * a[e])
                        .sum();
                    s * scale[x] as f64
                }
                Keys::E2m1 { packed, scale } => (0..d)
                    .map(|e| {
                        let b = packed[[x, e / 2]];
                        let code = if e % 2 == 0 { b & 0xF } else { b >> 4 };
                        (e2m1::decode(code) as f64).abs()
                            * a[e]
                            * ue8m0::decode(scale[[x, e / 32]]) as f64
                    })
                    .sum(),
            }
        })
        .collect()
}

/// The row's largest bound from SPEC 4: `2^-8 * max_j M_j`.
fn row_bound(p: &Problem, i: usize) -> f64 {
    magnitudes(p, i).into_iter().fold(0.0, f64::max) / 256.0
}

/// A score as a comparable f64: NaN is -inf (SPEC 5); -0.0 compares equal to +0.0.
fn val(x: f32) -> f64 {
    if x.is_nan() {
        f64::NEG_INFINITY
    } else {
        x as f64
    }
}

/// The `k`-th best score among `cands` under the ranking key.
fn kth_score(scores: &[f32], cands: &[usize], k: usize) -> f32 {
    if cands.is_empty() || k == 0 {
        return f32::NAN;
    }
    let mut keys: Vec<(u32, usize)> = cands.iter().map(|&j| (rank_key(scores[j]), j)).collect();
    let k = k.min(keys.len());
    keys.select_nth_unstable_by(k - 1, |a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    scores[keys[k - 1].1]
}

/// The ids of a row as a sorted set: every entry other than `-1` (an engine's top-k
/// may be unordered and padded anywhere). Values below `-1` and repeated ids are errors.
fn parse_row(row: &[i32]) -> std::result::Result<Vec<usize>, String> {
    if let Some(c) = row.iter().position(|&x| x < -1) {
        return Err(format!(
            "column {c} = {}, expected an id >= 0 or -1",
            row[c]
        ));
    }
    let mut ids: Vec<usize> = row
        .iter()
        .filter(|&&x| x >= 0)
        .map(|&x| x as usize)
        .collect();
    ids.sort_unstable();
    if let Some(w) = ids.windows(2).find(|w| w[0] == w[1]) {
        return Err(format!("id {} appears twice", w[0]));
    }
    Ok(ids)
}

/// SPEC 5's rule applied to an expected selection `exp` of `k` from `cands` under the
/// reference `scores`: `Ok` if it is a valid selection up to ties and `bound`,
/// otherwise the reasons.
fn check_selection(
    scores: &[f32],
    cands: &[usize],
    k: usize,
    exp: &[usize],
    bound: f64,
    what: &str,
) -> std::result::Result<(), Vec<String>> {
    let mut why = Vec::new();
    let want = cands.len().min(k);
    if exp.len() != want {
        why.push(format!(
            "expected selects {} {what}s, the reference {want}",
            exp.len()
        ));
    }
    let is_cand = |j: usize| cands.binary_search(&j).is_ok();
    for &j in exp {
        if !is_cand(j) {
            why.push(format!("expected {what} {j} is not a candidate"));
        }
    }
    if !why.is_empty() || cands.len() <= k {
        return if why.is_empty() { Ok(()) } else { Err(why) };
    }
    let kth = kth_score(scores, cands, k);
    let (lo, hi) = (val(kth) - bound, val(kth) + bound);
    for &j in exp {
        if val(scores[j]) < lo {
            why.push(format!(
                "expected selects {what} {j}: score {:e} < K-th score {:e} - bound {bound:.3e}",
                scores[j], kth
            ));
        }
    }
    let mut e = exp.iter().peekable();
    for &j in cands {
        while e.peek().is_some_and(|&&x| x < j) {
            e.next();
        }
        if e.peek() == Some(&&j) {
            continue;
        }
        if val(scores[j]) > hi {
            why.push(format!(
                "expected leaves out {what} {j}: score {:e} > K-th score {:e} + bound {bound:.3e}",
                scores[j], kth
            ));
        }
    }
    if why.is_empty() {
        Ok(())
    } else {
        Err(why)
    }
}

/// `a` abbreviated to its first and last few entries.
fn abbrev(a: &[usize], full: bool) -> String {
    if full || a.len() <= 16 {
        return format!("{a:?}");
    }
    let h: Vec<String> = a[..8].iter().map(|x| x.to_string()).collect();
    let t: Vec<String> = a[a.len() - 8..].iter().map(|x| x.to_string()).collect();
    format!("[{}, .., {}] ({} ids)", h.join(", "), t.join(", "), a.len())
}

/// Sorted difference `a \ b`.
fn minus(a: &[usize], b: &[usize]) -> Vec<usize> {
    a.iter()
        .filter(|x| b.binary_search(x).is_err())
        .copied()
        .collect()
}

impl Ctx<'_, '_> {
    fn cands(&self, i: usize) -> Vec<usize> {
        let n = self.p.batch.rows()[i].n;
        match self.p.role {
            Role::Consumer(c) => {
                let b = c.blocks.row(i);
                candidates::consumer_candidates(b.as_slice().unwrap_or(&[]), n, self.p.block_size)
                    .collect()
            }
            _ => (0..n).collect(),
        }
    }

    fn label(&self, i: usize) -> String {
        let r = self.p.batch.rows()[i];
        format!(
            "row {} (request {}, position {}, {} visible keys)",
            self.orig[i], r.request, r.position, r.n
        )
    }

    /// Compare selections row by row. `ours` and `exp` are request-local id rows.
    /// `same[i]`: the expected row is bitwise the replayed one.
    fn selections(
        &self,
        ours: &Array2<i32>,
        exp_ids: &[std::result::Result<Vec<usize>, String>],
        same: &[bool],
    ) -> TensorDiff {
        let p = self.p;
        let k = p.topk;
        let mut d = TensorDiff {
            compared: exp_ids.len(),
            ..Default::default()
        };
        let differing: Vec<usize> = (0..exp_ids.len()).filter(|&i| !same[i]).collect();
        let results: Vec<(usize, std::result::Result<(), Vec<String>>)> = differing
            .par_iter()
            .map(|&i| {
                let exp = match &exp_ids[i] {
                    Ok(e) => e,
                    Err(why) => return (i, Err(vec![format!("malformed expected row: {why}")])),
                };
                let o = parse_row(ours.row(i).as_slice().unwrap_or(&[])).unwrap_or_default();
                if *exp == o {
                    // The same ids, in another order or padding: no selection differs.
                    return (i, Ok(()));
                }
                let scores = row_scores(p, i);
                let bound = row_bound(p, i);
                (
                    i,
                    check_selection(&scores, &self.cands(i), k, exp, bound, "key"),
                )
            })
            .collect();
        for (i, r) in results {
            let bad = r.is_err();
            if bad {
                d.different += 1;
                d.first_row.get_or_insert(self.orig[i]);
            } else {
                d.tolerant += 1;
            }
            if d.notes.len() < self.max_show {
                let o = parse_row(ours.row(i).as_slice().unwrap_or(&[])).unwrap_or_default();
                let e = exp_ids[i].clone().unwrap_or_default();
                if e == o && !bad {
                    d.notes.push(format!(
                        "{}: the same ids, not in SPEC 5's sorted, -1-padded form",
                        self.label(i)
                    ));
                    continue;
                }
                let mut s = format!(
                    "{}: {}\n      expected: {}\n      replayed: {}",
                    self.label(i),
                    if bad {
                        "different"
                    } else {
                        "equal up to ties and tolerance"
                    },
                    abbrev(&e, self.verbose),
                    abbrev(&o, self.verbose),
                );
                let scores = row_scores(p, i);
                let cands = self.cands(i);
                let kth = kth_score(&scores, &cands, k);
                let bound = row_bound(p, i);
                for (label, set) in [
                    ("only expected", minus(&e, &o)),
                    ("only replayed", minus(&o, &e)),
                ] {
                    for &j in set.iter().take(8) {
                        let sc = scores.get(j).copied().unwrap_or(f32::NAN);
                        s += &format!(
                            "\n      {label}: key {j} reference score {sc:e} vs K-th score {kth:e} (diff {:.4e}, bound {bound:.3e})",
                            sc as f64 - kth as f64
                        );
                    }
                }
                if let Err(why) = &r {
                    for w in why.iter().take(4) {
                        s += &format!("\n      {w}");
                    }
                }
                d.notes.push(s);
            }
        }
        d
    }
}

/// Rows of a dump kept by `--rows` / `--request`, in original numbering.
fn select_rows(batch: &Batch, o: &Opts) -> Result<Vec<usize>> {
    let t = batch.num_rows();
    if let Some((a, b)) = o.rows {
        if a > b || b > t {
            bail!("--rows {a}..{b}: expected a range inside 0..{t}");
        }
    }
    if let Some(r) = o.request {
        if r >= batch.requests().len() {
            bail!(
                "--request {r}: the dump has {} requests",
                batch.requests().len()
            );
        }
    }
    Ok((0..t)
        .filter(|&i| o.rows.is_none_or(|(a, b)| (a..b).contains(&i)))
        .filter(|&i| o.request.is_none_or(|r| batch.rows()[i].request == r))
        .collect())
}

/// The dump restricted to rows `sel` (explicit layout), expected tensors included.
fn subset(d: &Dump, batch: &Batch, sel: &[usize]) -> Result<Dump> {
    let rows3 = |a: &Array3<u8>| a.select(Axis(0), sel);
    let q = match &d.q {
        QData::E4m3(q) => QData::E4m3(rows3(q)),
        QData::E2m1 { packed, scale } => QData::E2m1 {
            packed: rows3(packed),
            scale: rows3(scale),
        },
    };
    let e = &d.expected;
    let pick = |v: &Option<Vec<i32>>| v.as_ref().map(|v| sel.iter().map(|&i| v[i]).collect());
    let logits = match &e.logits {
        Some(l) => {
            let mut off = Vec::with_capacity(batch.num_rows() + 1);
            off.push(0usize);
            for r in batch.rows() {
                off.push(off.last().unwrap() + r.n);
            }
            if l.len() != *off.last().unwrap() {
                bail!(
                    "dump: tensor `expected_logits`: {} values, expected sum n = {}",
                    l.len(),
                    off.last().unwrap()
                );
            }
            Some(
                sel.iter()
                    .flat_map(|&i| l[off[i]..off[i + 1]].iter().copied())
                    .collect(),
            )
        }
        None => None,
    };
    let (published, published_rows) = match (&e.published, &e.published_rows) {
        (Some(pb), Some(pr)) => {
            let pos: HashMap<usize, usize> = sel
                .iter()
                .enumerate()
                .map(|(new, &old)| (old, new))
                .collect();
            let keep: Vec<(usize, i32)> = pr
                .iter()
                .enumerate()
                .filter_map(|(k, &r)| pos.get(&(r as usize)).map(|&new| (k, new as i32)))
                .collect();
            (
                Some(pb.select(Axis(0), &keep.iter().map(|x| x.0).collect::<Vec<_>>())),
                Some(keep.iter().map(|x| x.1).collect()),
            )
        }
        _ => (None, None),
    };
    let rows2 = |a: &Option<Array2<i32>>| a.as_ref().map(|a| a.select(Axis(0), sel));
    Ok(Dump {
        meta: d.meta.clone(),
        seq_lens: d.seq_lens.clone(),
        layout: Layout::Explicit {
            requests: sel.iter().map(|&i| batch.rows()[i].request).collect(),
            positions: sel.iter().map(|&i| batch.rows()[i].position).collect(),
        },
        q,
        k: d.k.clone(),
        weights: d.weights.select(Axis(0), sel),
        k_slots: d.k_slots.clone(),
        candidates: rows2(&d.candidates),
        engine_logits: d.engine_logits.as_ref().map(|a| a.select(Axis(0), sel)),
        expected: Expected {
            ks: pick(&e.ks),
            ke: pick(&e.ke),
            logits,
            raw: rows2(&e.raw),
            page: rows2(&e.page),
            published,
            published_rows,
        },
    })
}

/// Run `p` on `device`, tile by tile, with a progress bar on a terminal.
pub fn run_driver(p: &Problem, device: Device, budget: usize, progress: bool) -> Result<Output> {
    match device {
        Device::Cpu => {
            let mut b = indexer::CpuBackend::new();
            drive(&mut b, p, budget, progress)
        }
        Device::Cuda => crate::cuda_backend(|b| drive(b, p, budget, progress)),
    }
}

/// The chunked driver's loop ([`indexer::run`]) with a progress bar.
pub fn drive<B: Backend + ?Sized>(
    b: &mut B,
    p: &Problem,
    budget: usize,
    progress: bool,
) -> Result<Output> {
    let plan = indexer::plan_for(b, p, budget)?;
    let bar = if progress && std::io::stderr().is_terminal() {
        let bar = indicatif::ProgressBar::new(plan.tiles.len() as u64);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{spinner} replay [{bar:40}] {pos}/{len} tiles, {elapsed_precise} (eta {eta})",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        Some(bar)
    } else {
        None
    };
    let mut out = Output::alloc(p);
    b.begin(p, &plan)?;
    for t in 0..plan.tiles.len() {
        if let Err(e) = b.tile(p, &plan, t, &mut out) {
            let _ = b.end(p, &mut out);
            return Err(e.into());
        }
        if let Some(bar) = &bar {
            bar.inc(1);
        }
    }
    b.end(p, &mut out)?;
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    Ok(out)
}

/// Compare the dump's expected logits (`[sum n]`) or the engine's (`[T, L]`, inside
/// `[ks, ke)` only) with the replayed ones.
fn compare_logits(ctx: &Ctx, exp: Option<&[f32]>, engine: Option<&Array2<f32>>) -> TensorDiff {
    let p = ctx.p;
    let rows = p.batch.rows();
    let mut off = vec![0usize; rows.len() + 1];
    for (i, r) in rows.iter().enumerate() {
        off[i + 1] = off[i] + r.n;
    }
    let chunks: Vec<std::ops::Range<usize>> = (0..rows.len())
        .step_by(ROW_GROUP * 4)
        .map(|a| a..(a + ROW_GROUP * 4).min(rows.len()))
        .collect();
    // Per row: (elements differing beyond the bound, within it, first notes).
    type RowRes = (usize, usize, usize, Vec<String>);
    let per: Vec<RowRes> = chunks
        .par_iter()
        .flat_map_iter(|range| {
            let mut e = Engine::new(p);
            let mut res = Vec::new();
            for g0 in range.clone().step_by(ROW_GROUP) {
                let g1 = (g0 + ROW_GROUP).min(range.end);
                let idx: Vec<usize> = (g0..g1).collect();
                let mut bufs: Vec<Vec<f32>> = idx.iter().map(|&i| vec![0f32; rows[i].n]).collect();
                {
                    let mut outs: Vec<&mut [f32]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
                    e.rows(p, &idx, &mut outs);
                }
                for (&i, ours) in idx.iter().zip(&bufs) {
                    let theirs: Vec<f32> = match (exp, engine) {
                        (Some(x), _) => x[off[i]..off[i + 1]].to_vec(),
                        (None, Some(m)) => {
                            let r = rows[i];
                            m.row(i).iter().skip(r.ks).take(r.n).copied().collect()
                        }
                        _ => Vec::new(),
                    };
                    let diff: Vec<usize> = (0..ours.len())
                        .filter(|&j| ours[j].to_bits() != theirs[j].to_bits())
                        .collect();
                    if diff.is_empty() {
                        continue;
                    }
                    let m = magnitudes(p, i);
                    let (mut bad, mut tol, mut notes) = (0, 0, Vec::new());
                    for &j in &diff {
                        let b = m[j] / 256.0;
                        let ok = (theirs[j] as f64 - ours[j] as f64).abs() <= b;
                        if ok {
                            tol += 1;
                        } else {
                            bad += 1;
                        }
                        if notes.len() < 3 {
                            notes.push(format!(
                                "{}, key {j}: given {:e}, reference {:e} (diff {:.4e}, bound {b:.3e}){}",
                                ctx.label(i),
                                theirs[j],
                                ours[j],
                                theirs[j] as f64 - ours[j] as f64,
                                if ok { "" } else { " beyond the bound" }
                            ));
                        }
                    }
                    res.push((i, bad, tol, notes));
                }
            }
            res
        })
        .collect();
    let mut d = TensorDiff {
        compared: rows.len(),
        ..Default::default()
    };
    for (i, bad, _tol, notes) in per {
        if bad > 0 {
            d.different += 1;
            d.first_row.get_or_insert(ctx.orig[i]);
        } else {
            d.tolerant += 1;
        }
        for n in notes {
            if d.notes.len() < ctx.max_show {
                d.notes.push(n);
            }
        }
    }
    d
}

fn exact_rows(name: &str, ctx: &Ctx, ours: &[i32], theirs: &[i32], width: usize) -> TensorDiff {
    let mut d = TensorDiff {
        compared: theirs.len() / width.max(1),
        ..Default::default()
    };
    for i in 0..d.compared {
        let (a, b) = (
            &ours[i * width..(i + 1) * width],
            &theirs[i * width..(i + 1) * width],
        );
        if a != b {
            d.different += 1;
            d.first_row.get_or_insert(ctx.orig[i]);
            if d.notes.len() < ctx.max_show {
                d.notes.push(format!(
                    "{}: {name} expected {b:?}, replayed {a:?}",
                    ctx.label(i)
                ));
            }
        }
    }
    d
}

/// Compare published candidate blocks row by row (SPEC 6 up to ties and the bound).
fn compare_published(
    ctx: &Ctx,
    ours: &Output,
    exp: &Array2<i32>,
    exp_rows: &[usize],
) -> TensorDiff {
    let p = ctx.p;
    let Some(pb) = &ours.published else {
        return TensorDiff {
            different: 1,
            notes: vec!["the dump has expected_published but the layer is not a source".into()],
            ..Default::default()
        };
    };
    let our_rows: Vec<usize> = (0..p.batch.num_rows())
        .filter(|&i| p.publishes(i))
        .collect();
    let mut d = TensorDiff {
        compared: exp.nrows(),
        ..Default::default()
    };
    if our_rows != exp_rows || exp.shape() != pb.blocks.shape() {
        d.different += 1;
        d.notes.push(format!(
            "published rows differ: expected {} rows {}, replayed {} rows {} (width {} vs {})",
            exp_rows.len(),
            abbrev(exp_rows, false),
            our_rows.len(),
            abbrev(&our_rows, false),
            exp.ncols(),
            pb.blocks.ncols()
        ));
        return d;
    }
    let bs = p.block_size;
    for (k, &i) in our_rows.iter().enumerate() {
        let (a, b) = (pb.blocks.row(k), exp.row(k));
        if a == b {
            continue;
        }
        let n = p.batch.rows()[i].n;
        let ours_set = parse_row(a.as_slice().unwrap_or(&[])).unwrap_or_default();
        let res = match parse_row(b.as_slice().unwrap_or(&[])) {
            Err(e) => Err(vec![e]),
            Ok(e) if e == ours_set => Ok(()),
            Ok(e) if n == 0 => Err(vec![format!(
                "row has no visible keys, expected publishes {}",
                abbrev(&e, false)
            )]),
            Ok(e) => {
                let scores = row_scores(p, i);
                let nb = n.div_ceil(bs);
                // Block scores: the best visible key of each block.
                let block: Vec<f32> = (0..nb)
                    .map(|c| {
                        scores[c * bs..((c + 1) * bs).min(n)]
                            .iter()
                            .copied()
                            .max_by_key(|&x| rank_key(x))
                            .unwrap_or(f32::NEG_INFINITY)
                    })
                    .collect();
                let pinned = (n - 1) / bs;
                if e.binary_search(&pinned).is_err() {
                    Err(vec![format!("pinned block {pinned} not kept")])
                } else {
                    let others: Vec<usize> = (0..nb).filter(|&c| c != pinned).collect();
                    let exp_others: Vec<usize> =
                        e.iter().copied().filter(|&c| c != pinned).collect();
                    let keep = p.num_blocks.min(nb) - 1;
                    check_selection(&block, &others, keep, &exp_others, row_bound(p, i), "block")
                }
            }
        };
        let bad = res.is_err();
        if bad {
            d.different += 1;
            d.first_row.get_or_insert(ctx.orig[i]);
        } else {
            d.tolerant += 1;
        }
        if d.notes.len() < ctx.max_show {
            let mut s = format!(
                "{}: published blocks {}",
                ctx.label(i),
                if bad {
                    "different"
                } else {
                    "equal up to ties and tolerance"
                }
            );
            if let Err(why) = res {
                for w in why.iter().take(4) {
                    s += &format!("\n      {w}");
                }
            }
            d.notes.push(s);
        }
    }
    d
}

/// `page` against the slots of the expected `raw` ids (the selection itself is judged
/// on `raw`): identical when it is SPEC 5's form of those slots, equal up to order when
/// it holds the same slots otherwise placed, else different.
fn page_vs_raw(
    ctx: &Ctx,
    ids: &[std::result::Result<Vec<usize>, String>],
    page: &Array2<i32>,
) -> TensorDiff {
    let p = ctx.p;
    let mut d = TensorDiff {
        compared: page.nrows(),
        ..Default::default()
    };
    for (i, id) in ids.iter().enumerate() {
        let r = p.batch.rows()[i];
        let row = page.row(i);
        let ids = id.clone().unwrap_or_default();
        let slots: Vec<i32> = ids
            .iter()
            .map(|&j| if j < r.n { p.slot(r.ks + j) } else { -2 })
            .collect();
        let canonical = (0..p.page_cols).map(|c| slots.get(c).copied().unwrap_or(-1));
        if row.iter().copied().eq(canonical) {
            continue;
        }
        let mut have: Vec<i32> = row.iter().copied().filter(|&x| x != -1).collect();
        let mut want = slots.clone();
        have.sort_unstable();
        want.sort_unstable();
        let same_set = have == want;
        if same_set {
            d.tolerant += 1;
        } else {
            d.different += 1;
            d.first_row.get_or_insert(ctx.orig[i]);
        }
        if d.notes.len() < ctx.max_show {
            d.notes.push(if same_set {
                format!(
                    "{}: page holds the slots of expected_raw in another order",
                    ctx.label(i)
                )
            } else {
                format!(
                    "{}: page slots {:?} are not the slots {:?} of expected_raw's keys",
                    ctx.label(i),
                    have,
                    want
                )
            });
        }
    }
    d
}

/// Expected request-local ids per row from `page` through the inverse slot map.
fn ids_from_page(p: &Problem, page: &Array2<i32>) -> Vec<std::result::Result<Vec<usize>, String>> {
    (0..p.batch.num_rows())
        .map(|i| {
            let r = p.batch.rows()[i];
            let inv: HashMap<i32, usize> = (0..r.n).map(|j| (p.slot(r.ks + j), j)).collect();
            let row = page.row(i);
            let slots = row.as_slice().unwrap_or(&[]);
            if let Some(c) = slots.iter().position(|&x| x < -1) {
                return Err(format!(
                    "column {c} = {}, expected a slot >= 0 or -1",
                    slots[c]
                ));
            }
            let mut js = Vec::new();
            for &s in slots.iter().filter(|&&x| x >= 0) {
                match inv.get(&s) {
                    Some(&j) => js.push(j),
                    None => return Err(format!("slot {s} is not a visible key's slot")),
                }
            }
            js.sort_unstable();
            if let Some(w) = js.windows(2).find(|w| w[0] == w[1]) {
                return Err(format!("key {} appears twice", w[0]));
            }
            Ok(js)
        })
        .collect()
}

/// `replay FILE`. Returns the exit code: 0 identical or equal up to ties and
/// tolerance, 1 different.
pub fn replay(o: &Opts) -> Result<i32> {
    let t0 = Instant::now();
    let name = o.file.display().to_string();
    let bytes = std::fs::read(&o.file).map_err(|e| CliError::input(format!("{name}: {e}")))?;
    let with_name = |e: dsa_indexer::Error| CliError::input(format!("{name}: {e}"));
    let full = Dump::from_bytes(&bytes).map_err(with_name)?;
    drop(bytes);
    let full_batch = full.batch().map_err(with_name)?;
    let sel = select_rows(&full_batch, o)?;
    let partial = sel.len() != full_batch.num_rows();
    let dump = if partial {
        subset(&full, &full_batch, &sel)?
    } else {
        full
    };
    let batch = if partial {
        dump.batch().map_err(with_name)?
    } else {
        full_batch
    };
    let published = dump.published_input(&batch);
    let p = dump
        .problem(&batch, published.as_ref())
        .map_err(with_name)?;
    let e = &dump.expected;
    // Shapes of the expected tensors.
    let t = batch.num_rows();
    for (tname, arr, w) in [
        ("expected_raw", &e.raw, Some(p.topk)),
        ("expected_page", &e.page, Some(p.page_cols)),
    ] {
        if let Some(a) = arr {
            if a.nrows() != t || Some(a.ncols()) != w {
                bail!(
                    "{name}: dump: tensor `{tname}`: shape {:?}, expected [{t}, {}]",
                    a.shape(),
                    w.unwrap_or(0)
                );
            }
        }
    }
    for (tname, v) in [("expected_ks", &e.ks), ("expected_ke", &e.ke)] {
        if let Some(v) = v {
            if v.len() != t {
                bail!(
                    "{name}: dump: tensor `{tname}`: shape [{}], expected [{t}]",
                    v.len()
                );
            }
        }
    }
    if let Some(l) = &e.logits {
        if l.len() != batch.valid_pairs() {
            bail!(
                "{name}: dump: tensor `expected_logits`: shape [{}], expected [{}] (sum n)",
                l.len(),
                batch.valid_pairs()
            );
        }
    }
    if let Some(m) = &dump.engine_logits {
        if m.shape() != [t, batch.num_keys()] {
            bail!(
                "{name}: dump: tensor `engine_logits`: shape {:?}, expected [{t}, {}]",
                m.shape(),
                batch.num_keys()
            );
        }
    }
    if let (Some(pb), Some(pr)) = (&e.published, &e.published_rows) {
        if pb.nrows() != pr.len() {
            bail!(
                "{name}: dump: tensor `expected_published_rows`: shape [{}], expected [{}] (rows of expected_published)",
                pr.len(),
                pb.nrows()
            );
        }
        if let Some(&r) = pr.iter().find(|&&r| r < 0 || r as usize >= t) {
            bail!("{name}: dump: tensor `expected_published_rows`: row {r} outside 0..{t}");
        }
    }
    let t_parse = t0.elapsed().as_secs_f64();

    let t1 = Instant::now();
    let budget = o.budget.unwrap_or_else(|| {
        let logits: usize = batch
            .rows()
            .iter()
            .map(|r| r.n.div_ceil(4) * 16)
            .fold(0, usize::saturating_add);
        (logits / 32).clamp(16 << 20, 256 << 20)
    });
    let out = run_driver(&p, o.device, budget, true)?;
    let t_run = t1.elapsed().as_secs_f64();

    let t2 = Instant::now();
    let ctx = Ctx {
        p: &p,
        orig: &sel,
        max_show: o.max_show,
        verbose: o.verbose,
    };
    let mut diffs: Vec<(&str, TensorDiff)> = Vec::new();
    let ks: Vec<i32> = batch.rows().iter().map(|r| r.ks as i32).collect();
    let ke: Vec<i32> = batch.rows().iter().map(|r| r.ke() as i32).collect();
    if let Some(v) = &e.ks {
        diffs.push(("ks", exact_rows("ks", &ctx, &ks, v, 1)));
    }
    if let Some(v) = &e.ke {
        diffs.push(("ke", exact_rows("ke", &ctx, &ke, v, 1)));
    }
    let raw_ids: Option<Vec<std::result::Result<Vec<usize>, String>>> = e.raw.as_ref().map(|raw| {
        raw.rows()
            .into_iter()
            .map(|r| parse_row(r.as_slice().unwrap_or(&[])))
            .collect()
    });
    let same_rows = |a: &Array2<i32>, b: &Array2<i32>| -> Vec<bool> {
        a.rows()
            .into_iter()
            .zip(b.rows())
            .map(|(x, y)| x == y)
            .collect()
    };
    if let (Some(ids), Some(raw)) = (&raw_ids, &e.raw) {
        diffs.push((
            "raw",
            ctx.selections(&out.raw, ids, &same_rows(raw, &out.raw)),
        ));
    }
    if let Some(page) = &e.page {
        match &raw_ids {
            // The page of a valid selection is its slots: compare it with the slots of
            // the expected raw row; the selection itself was judged on `raw`.
            Some(ids) => diffs.push(("page", page_vs_raw(&ctx, ids, page))),
            None => {
                let ids = ids_from_page(&p, page);
                diffs.push((
                    "page",
                    ctx.selections(&out.raw, &ids, &same_rows(page, &out.page)),
                ));
            }
        }
    }
    if let Some(pb) = &e.published {
        let rows: Vec<usize> = e
            .published_rows
            .as_ref()
            .map(|v| v.iter().map(|&x| x as usize).collect())
            .unwrap_or_else(|| (0..t).filter(|&i| p.publishes(i)).collect());
        diffs.push(("published", compare_published(&ctx, &out, pb, &rows)));
    }
    if let Some(l) = &e.logits {
        diffs.push(("logits", compare_logits(&ctx, Some(l), None)));
    }
    if let Some(m) = &dump.engine_logits {
        diffs.push(("engine_logits", compare_logits(&ctx, None, Some(m))));
    }
    let t_diff = t2.elapsed().as_secs_f64();

    let different = diffs.iter().any(|(_, d)| d.different > 0);
    let tolerant = diffs.iter().any(|(_, d)| d.tolerant > 0);
    let verdict = if diffs.is_empty() {
        "no expected outputs"
    } else if different {
        "different"
    } else if tolerant {
        "equal up to ties and tolerance"
    } else {
        "identical"
    };
    let cls = match p.class() {
        dsa_indexer::problem::Class::Exact => "exact",
        dsa_indexer::problem::Class::Tolerance => "tolerance",
    };
    if o.json {
        let tensors: serde_json::Map<String, serde_json::Value> = diffs
            .iter()
            .map(|(n, d)| {
                (
                    n.to_string(),
                    json!({
                        "status": d.status(),
                        "compared_rows": d.compared,
                        "rows_tolerant": d.tolerant,
                        "rows_different": d.different,
                        "first_different_row": d.first_row,
                        "notes": d.notes,
                    }),
                )
            })
            .collect();
        let j = json!({
            "file": name,
            "verdict": verdict,
            "rows": t,
            "keys": batch.num_keys(),
            "heads": p.heads, "dim": p.dim, "topk": p.topk, "ratio": batch.ratio(),
            "q_format": p.q_format().to_string(), "k_format": p.k_format().to_string(),
            "class": cls, "role": p.role.name(),
            "device": o.device.name(),
            "seconds": { "parse": t_parse, "run": t_run, "diff": t_diff },
            "tensors": tensors,
        });
        println!("{}", serde_json::to_string_pretty(&j).unwrap_or_default());
    } else {
        println!(
            "replay {name}: {t} rows{}, {} keys, H={} D={} K={} ratio {}, {} x {} ({cls} class), {}",
            if partial { " (selected)" } else { "" },
            batch.num_keys(),
            p.heads,
            p.dim,
            p.topk,
            batch.ratio(),
            p.q_format(),
            p.k_format(),
            p.role.name()
        );
        println!(
            "  parse {t_parse:.2} s, run {t_run:.2} s on {} (budget {}), diff {t_diff:.2} s",
            o.device.describe(),
            human_bytes(budget as u128)
        );
        for (n, d) in &diffs {
            let what = if *n == "logits" || *n == "engine_logits" {
                "rows with differing values"
            } else {
                "rows differ"
            };
            if d.different + d.tolerant == 0 {
                println!("  {n:<14} identical ({} rows)", d.compared);
            } else {
                println!(
                    "  {n:<14} {}: {} of {} {what} ({} only within ties/tolerance, {} beyond)",
                    d.status(),
                    d.different + d.tolerant,
                    d.compared,
                    d.tolerant,
                    d.different
                );
            }
            for note in &d.notes {
                println!("    {note}");
            }
        }
        println!("verdict: {verdict}");
    }
    if let Some(i) = o.show_row {
        show_row(&p, &sel, i, &out, e)?;
    }
    Ok(if different { 1 } else { 0 })
}

/// `--show-row I`: a row's scores and selections.
fn show_row(p: &Problem, sel: &[usize], orig: usize, out: &Output, e: &Expected) -> Result<()> {
    let Some(i) = sel.iter().position(|&x| x == orig) else {
        bail!("--show-row {orig}: not among the replayed rows");
    };
    let r = p.batch.rows()[i];
    let scores = row_scores(p, i);
    let ctx = Ctx {
        p,
        orig: sel,
        max_show: 0,
        verbose: true,
    };
    let cands = ctx.cands(i);
    println!(
        "{}: ks {}, ke {}, {} candidates, bound {:.3e}",
        ctx.label(i),
        r.ks,
        r.ke(),
        cands.len(),
        row_bound(p, i)
    );
    if !cands.is_empty() {
        println!("  K-th score: {:e}", kth_score(&scores, &cands, p.topk));
    }
    let mut ranked: Vec<usize> = cands.clone();
    ranked.sort_by(|&a, &b| {
        rank_key(scores[b])
            .cmp(&rank_key(scores[a]))
            .then(a.cmp(&b))
    });
    println!("  best {} by score:", ranked.len().min(32));
    for &j in ranked.iter().take(32) {
        println!("    key {j:>8}  {:e}", scores[j]);
    }
    let ours = parse_row(out.raw.row(i).as_slice().unwrap_or(&[])).unwrap_or_default();
    println!("  replayed raw: {}", abbrev(&ours, true));
    if let Some(raw) = &e.raw {
        println!(
            "  expected raw: {:?}",
            raw.row(i)
                .iter()
                .take_while(|&&x| x >= 0)
                .collect::<Vec<_>>()
        );
    }
    println!(
        "  replayed page: {:?}",
        out.page
            .row(i)
            .iter()
            .take_while(|&&x| x >= 0)
            .collect::<Vec<_>>()
    );
    if r.n <= 64 {
        println!("  all scores: {:?}", scores);
    }
    Ok(())
}
