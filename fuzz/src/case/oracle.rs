//! The oracle's checks, each computed independently of the crate's code where it can
//! be: SPEC 3's layout, SPEC 4's magnitude and logits (bitwise or within a stated
//! bound), SPEC 5 and 6's output rules, SPEC 7's plan, and the reference's selection
//! from given scores.

use approx::abs_diff_eq;

use dsa_indexer::batch::Batch;
use dsa_indexer::plan::Plan;
use dsa_indexer::problem::{KeyRef, Problem, Queries, Role};
use dsa_indexer::reference::{self, Output};

use super::subject::LogitBound;

/// SPEC 3 for a validated batch, computed independently.
pub fn check_layout(batch: &Batch) {
    let r = batch.ratio();
    let mut off = 0usize;
    for req in batch.requests() {
        assert_eq!(req.key_offset, off, "key offset");
        assert_eq!(req.keys, req.seq_len / r, "lc_b");
        off += req.keys;
    }
    assert_eq!(batch.num_keys(), off, "L");
    for row in batch.rows() {
        let req = batch.requests()[row.request];
        assert!(row.position < req.seq_len, "position < S_b");
        assert_eq!(row.n, (row.position + 1) / r, "n(p)");
        assert_eq!(row.ks, req.key_offset, "ks");
        assert!(
            row.ke() <= req.key_offset + req.keys,
            "ke within the request"
        );
    }
}

/// The reference's epilogue (candidate blocks, top-k, index assembly) on given scores,
/// each row's `n` scores concatenated.
pub fn select_from_scores(p: &Problem, scores: &[f32]) -> Output {
    let mut out = Output::alloc(p);
    let mut s = reference::RowScratch::new(p);
    let (mut off, mut k) = (0usize, 0usize);
    for (i, row) in p.batch.rows().iter().enumerate() {
        let sc = &scores[off..off + row.n];
        off += row.n;
        let publishes = p.publishes(i);
        let mut keys = vec![
            0u32;
            if publishes {
                row.n.div_ceil(p.block_size)
            } else {
                0
            }
        ];
        let mut blocks = publishes.then(|| vec![-1i32; p.num_blocks]);
        let mut raw = vec![-1i32; p.topk];
        let mut page = vec![-1i32; p.page_cols];
        reference::finish_row(
            p,
            i,
            sc,
            &mut keys,
            blocks.as_deref_mut(),
            &mut raw,
            &mut page,
            &mut s,
        );
        out.raw.row_mut(i).assign(&ndarray::ArrayView1::from(&raw));
        out.page
            .row_mut(i)
            .assign(&ndarray::ArrayView1::from(&page));
        if let (Some(b), Some(pb)) = (blocks, out.published.as_mut()) {
            pb.blocks.row_mut(k).assign(&ndarray::ArrayView1::from(&b));
            k += 1;
        }
    }
    out
}

/// Logits bitwise (`bound = None`) or within `bound(p, i, j, M)` of the reference's.
/// Within a bound, a non-finite logit on either side must match the other exactly:
/// the same infinity, or NaN on both sides (SPEC 5 ranks every NaN alike, as -inf).
/// An infinity against a finite value, or against the other infinity, is an infinite
/// difference, and NaN against anything but NaN has none: neither is within a bound.
pub fn check_logits(p: &Problem, name: &str, got: &[f32], want: &[f32], bound: Option<LogitBound>) {
    assert_eq!(got.len(), want.len(), "{name}: logits length");
    let mut off = 0usize;
    for (i, row) in p.batch.rows().iter().enumerate() {
        for j in 0..row.n {
            let (x, r) = (got[off + j], want[off + j]);
            let same = x.to_bits() == r.to_bits() || (x.is_nan() && r.is_nan());
            match bound {
                None => assert!(
                    same,
                    "{name}: logit [{i}, {j}] = {x:e} ({:#010x}), reference {r:e} ({:#010x})",
                    x.to_bits(),
                    r.to_bits()
                ),
                Some(bound) if !same => {
                    let b = bound(p, i, j, magnitude(p, i, j));
                    assert!(
                        x.is_finite() && r.is_finite(),
                        "{name}: logit [{i}, {j}] = {x:e}, reference {r:e}: a non-finite \
                         logit must equal the other side's"
                    );
                    assert!(
                        abs_diff_eq!(x as f64, r as f64, epsilon = b),
                        "{name}: logit [{i}, {j}] = {x:e}, reference {r:e}, bound {b:e}"
                    );
                }
                Some(_) => {}
            }
        }
        off += row.n;
    }
}

/// SPEC 5's ranking key of a score, in f64: NaN counts as -infinity (and -0.0 equals
/// +0.0 under f64's `<`).
fn rank(x: f32) -> f64 {
    if x.is_nan() {
        f64::NEG_INFINITY
    } else {
        x as f64
    }
}

/// The `k`-th largest (from 1) of `v`.
fn kth_largest(v: impl Iterator<Item = f64>, k: usize) -> f64 {
    let mut v: Vec<f64> = v.collect();
    v.sort_by(|a, b| b.total_cmp(a));
    v[k - 1]
}

/// The candidates of row `i` (request-local `j < n`): every visible key, or for a
/// consumer the visible keys of its kept blocks, computed from the published ids.
fn candidates(p: &Problem, i: usize, n: usize) -> Vec<usize> {
    match p.role {
        Role::Consumer(c) => {
            let mut keep = vec![false; n];
            for &b in c.blocks.row(i).iter().filter(|&&b| b >= 0) {
                let lo = (b as usize * p.block_size).min(n);
                let hi = (lo + p.block_size).min(n);
                keep[lo..hi].iter_mut().for_each(|k| *k = true);
            }
            (0..n).filter(|&j| keep[j]).collect()
        }
        _ => (0..n).collect(),
    }
}

/// SPEC 5's correctness rule for a selection computed from scores within `bound` of
/// the reference's, checked on the reference's scores `want` (rows concatenated):
/// the row selects `min(m, K)` of its `m` candidates, all of them when `m <= K`;
/// otherwise every selected key's reference score is at least the reference's `K`-th
/// best minus the row's largest bound, and every unselected candidate's at most that
/// plus the bound. And SPEC 7's rule for published blocks: the pinned block kept, the
/// others the same rule on reference block scores (the best visible key of a block).
pub fn check_selection(p: &Problem, out: &Output, want: &[f32], bound: LogitBound) {
    let mut off = 0usize;
    let mut k = 0usize;
    for (i, row) in p.batch.rows().iter().enumerate() {
        let (n, s) = (row.n, &want[off..off + row.n]);
        off += n;
        let b: Vec<f64> = (0..n).map(|j| bound(p, i, j, magnitude(p, i, j))).collect();
        let cands = candidates(p, i, n);
        let sel: Vec<usize> = out
            .raw
            .row(i)
            .iter()
            .filter(|&&j| j >= 0)
            .map(|&j| j as usize)
            .collect();
        assert_eq!(
            sel.len(),
            cands.len().min(p.topk),
            "row {i}: selected count"
        );
        assert!(
            sel.iter().all(|j| cands.contains(j)),
            "row {i}: selected a non-candidate"
        );
        if cands.len() > p.topk {
            let kth = kth_largest(cands.iter().map(|&j| rank(s[j])), p.topk);
            let rb = cands.iter().map(|&j| b[j]).fold(0f64, f64::max);
            for &j in &cands {
                let v = rank(s[j]);
                if sel.contains(&j) {
                    assert!(
                        v >= kth - rb,
                        "row {i}: selected {j} with {v:e} < {kth:e} - {rb:e}"
                    );
                } else {
                    assert!(
                        v <= kth + rb,
                        "row {i}: left out {j} with {v:e} > {kth:e} + {rb:e}"
                    );
                }
            }
        }
        if p.publishes(i) {
            let pb = out.published.as_ref().expect("a source publishes");
            check_kept_blocks(p, i, pb.blocks.row(k).as_slice().unwrap(), s, &b);
            k += 1;
        }
    }
}

/// SPEC 6's kept blocks of row `i` (`ids`, `-1`-padded) against reference scores `s`
/// within bounds `b`: the pinned block and `min(NB, nb) - 1` others whose reference
/// block scores meet SPEC 5's rule among the unpinned blocks.
fn check_kept_blocks(p: &Problem, i: usize, ids: &[i32], s: &[f32], b: &[f64]) {
    let n = s.len();
    let kept: Vec<usize> = ids
        .iter()
        .filter(|&&c| c >= 0)
        .map(|&c| c as usize)
        .collect();
    if n == 0 {
        assert!(
            kept.is_empty(),
            "row {i}: a row without keys keeps no block"
        );
        return;
    }
    let (bs, nb) = (p.block_size, n.div_ceil(p.block_size));
    let pinned = (n - 1) / bs;
    assert!(
        kept.contains(&pinned),
        "row {i}: pinned block {pinned} not kept"
    );
    assert_eq!(
        kept.len(),
        nb.min(p.num_blocks),
        "row {i}: kept blocks count"
    );
    assert!(kept.iter().all(|&c| c < nb), "row {i}: kept a block past n");
    let others = p.num_blocks.min(nb) - 1;
    if others == 0 || nb - 1 <= others {
        return;
    }
    let score = |c: usize| {
        (c * bs..(c * bs + bs).min(n))
            .map(|j| rank(s[j]))
            .fold(f64::NEG_INFINITY, f64::max)
    };
    let rest: Vec<usize> = (0..nb).filter(|&c| c != pinned).collect();
    let kth = kth_largest(rest.iter().map(|&c| score(c)), others);
    let rb = b.iter().copied().fold(0f64, f64::max);
    for &c in &rest {
        let v = score(c);
        if kept.contains(&c) {
            assert!(
                v >= kth - rb,
                "row {i}: kept block {c} with {v:e} < {kth:e} - {rb:e}"
            );
        } else {
            assert!(
                v <= kth + rb,
                "row {i}: left out block {c} with {v:e} > {kth:e} + {rb:e}"
            );
        }
    }
}

/// SPEC 4's `M` for row `i`, visible key `j`:
/// `kscale_j * sum_h |w_h| * sum_g c_g * sum_{d in g} |q_d * k_d|`.
pub fn magnitude(p: &Problem, i: usize, j: usize) -> f64 {
    use dsa_indexer::formats::{e2m1, e4m3, ue8m0};
    let (d, g) = (p.dim, p.dim / 32);
    let (kv, kc, ks): (Vec<f64>, Vec<f64>, f64) = match p.key(&p.batch.rows()[i], j) {
        KeyRef::E4m3 { codes, scale } => (
            codes.iter().map(|&b| e4m3::decode(b) as f64).collect(),
            vec![1.0; g],
            scale as f64,
        ),
        KeyRef::E2m1 { packed, scale } => {
            let row = packed.to_vec();
            (
                (0..d)
                    .map(|e| e2m1::decode(e2m1::unpack(&row, e)) as f64)
                    .collect(),
                scale.iter().map(|&e| ue8m0::decode(e) as f64).collect(),
                1.0,
            )
        }
    };
    let mut m = 0f64;
    for h in 0..p.heads {
        let (qv, qc): (Vec<f64>, Vec<f64>) = match p.inputs.q {
            Queries::E4m3(q) => (
                q.slice(ndarray::s![i, h, ..])
                    .iter()
                    .map(|&b| e4m3::decode(b) as f64)
                    .collect(),
                vec![1.0; g],
            ),
            Queries::E2m1 { packed, scale } => {
                let row = packed.slice(ndarray::s![i, h, ..]).to_vec();
                (
                    (0..d)
                        .map(|e| e2m1::decode(e2m1::unpack(&row, e)) as f64)
                        .collect(),
                    scale
                        .slice(ndarray::s![i, h, ..])
                        .iter()
                        .map(|&e| ue8m0::decode(e) as f64)
                        .collect(),
                )
            }
        };
        let mut sum = 0f64;
        for gg in 0..g {
            let dots: f64 = (gg * 32..gg * 32 + 32).map(|e| (qv[e] * kv[e]).abs()).sum();
            sum += qc[gg] * kc[gg] * dots;
        }
        m += (p.inputs.weights[[i, h]] as f64).abs() * sum;
    }
    ks * m
}

/// SPEC 5 and 6 shape rules of an output, independent of how it was computed.
pub fn check_output(p: &Problem, out: &Output) {
    let rows = p.batch.rows();
    assert_eq!(out.raw.dim(), (rows.len(), p.topk), "raw shape");
    assert_eq!(out.page.dim(), (rows.len(), p.page_cols), "page shape");
    for (i, row) in rows.iter().enumerate() {
        let raw = out.raw.row(i);
        let sel: Vec<i32> = raw.iter().copied().take_while(|&j| j >= 0).collect();
        assert!(raw.iter().skip(sel.len()).all(|&j| j == -1), "raw padding");
        assert!(sel.windows(2).all(|w| w[0] < w[1]), "raw ascending");
        assert!(sel.iter().all(|&j| (j as usize) < row.n), "raw visible");
        if !matches!(p.role, Role::Consumer(_)) {
            assert_eq!(sel.len(), row.n.min(p.topk), "raw count");
        }
        for (c, &g) in out.page.row(i).iter().enumerate() {
            let want = sel.get(c).map_or(-1, |&j| p.slot(row, j as usize));
            assert_eq!(g, want, "page[{i}, {c}]");
        }
    }
    if let Some(pb) = &out.published {
        let mut k = 0;
        for (i, row) in rows.iter().enumerate() {
            // SPEC 6, independently of the crate: the rows at `p >= S_b - tail`.
            let s = p.batch.requests()[row.request].seq_len as u128;
            let publishes = match p.role {
                Role::Source { tail: Some(t) } => row.position as u128 + t as u128 >= s,
                _ => true,
            };
            assert_eq!(p.publishes(i), publishes, "row {i} publishes");
            if !publishes {
                continue;
            }
            assert_eq!(pb.rows[k], (row.request, row.position), "published row");
            let ids: Vec<i32> = pb
                .blocks
                .row(k)
                .iter()
                .copied()
                .take_while(|&c| c >= 0)
                .collect();
            let nb = row.n.div_ceil(p.block_size);
            assert_eq!(ids.len(), nb.min(p.num_blocks), "kept blocks count");
            assert!(ids.windows(2).all(|w| w[0] < w[1]), "kept ascending");
            if row.n > 0 {
                assert!(
                    ids.contains(&(((row.n - 1) / p.block_size) as i32)),
                    "pinned block kept"
                );
            }
            k += 1;
        }
        assert_eq!(k, pb.rows.len(), "published row count");
    }
}

/// SPEC 7: tiles cover the rows in order; each fits the budget or is one oversized row.
pub fn check_plan(p: &Problem, plan: &Plan, budget: usize) {
    let mut next = 0;
    let mut pubs = 0;
    for t in &plan.tiles {
        assert_eq!(t.rows.start, next, "tiles in order");
        assert!(!t.rows.is_empty(), "empty tile");
        next = t.rows.end;
        assert_eq!(t.published.start, pubs, "published ranges in order");
        pubs += t.rows.clone().filter(|&i| p.publishes(i)).count();
        assert_eq!(t.published.end, pubs, "published range");
        if t.logits_bytes > budget {
            assert!(t.oversized && t.rows.len() == 1, "tile over budget");
        }
        assert!(t.logits_bytes <= plan.peak.logits_tile, "peak covers tiles");
    }
    assert_eq!(next, p.batch.num_rows(), "tiles cover the rows");
}
