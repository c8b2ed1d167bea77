//! Logits against the reference, value by value, within SPEC 4's bound
//! `2^-8 * M_j + A_j` ([`bounds`]).

use ndarray::Array2;
use rayon::prelude::*;

use super::bound::bounds;
use super::{Rows, Tally};
use crate::cpu::{Engine, ROW_GROUP};

/// The logits a dump gives.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Given<'a> {
    /// `expected_logits`: each row's visible scores, rows concatenated, `[sum n]`.
    Flat(&'a [f32]),
    /// `engine_logits`: over the flat key buffer, `[T, L]`; only `[ks, ke)` counts.
    Engine(&'a Array2<f32>),
}

/// One row's differing values: (row, beyond the bound, within it, first notes).
type RowRes = (usize, usize, usize, Vec<String>);

/// Compare the dump's logits with the replayed ones.
pub(crate) fn compare_logits(ctx: &Rows, given: Given) -> Tally {
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
                    let theirs: Vec<f32> = match given {
                        Given::Flat(x) => x[off[i]..off[i + 1]].to_vec(),
                        Given::Engine(m) => {
                            let r = rows[i];
                            m.row(i).iter().skip(r.ks).take(r.n).copied().collect()
                        }
                    };
                    res.extend(compare_row(ctx, i, ours, &theirs));
                }
            }
            res
        })
        .collect();
    let mut d = Tally {
        compared: rows.len(),
        ..Default::default()
    };
    for (i, bad, _tol, notes) in per {
        d.count(bad > 0, ctx.orig[i]);
        for n in notes {
            if d.notes.len() < ctx.max_show {
                d.notes.push(n);
            }
        }
    }
    d
}

/// Row `i`'s given values `theirs` against the reference's `ours`; `None` when every
/// value is bitwise the same.
fn compare_row(ctx: &Rows, i: usize, ours: &[f32], theirs: &[f32]) -> Option<RowRes> {
    let diff: Vec<usize> = (0..ours.len())
        .filter(|&j| ours[j].to_bits() != theirs[j].to_bits())
        .collect();
    if diff.is_empty() {
        return None;
    }
    let bound = bounds(ctx.p, i);
    let (mut bad, mut tol, mut notes) = (0, 0, Vec::new());
    for &j in &diff {
        let b = bound[j];
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
    Some((i, bad, tol, notes))
}
