//! Logits against the reference, value by value, within SPEC 4's bound of the class:
//! bitwise in the exact class, `2^-8 * M_j + A_j` ([`bounds`]) in the tolerance class.
//! Each row's largest `|x - ref|` is also the measured error that SPEC 9 turns into the
//! tolerance of the engine's selections.

use ndarray::Array2;
use rayon::prelude::*;

use super::bound::{bounds, magnitudes};
use super::{RowError, Rows, Status, Tally};
use crate::cpu::{Engine, ROW_GROUP};
use crate::problem::Class;

/// The logits a dump gives.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Given<'a> {
    /// `expected_logits`: each row's visible scores, rows concatenated, `[sum n]`.
    Flat(&'a [f32]),
    /// `engine_logits`: over the flat key buffer, `[T, L]`; only `[ks, ke)` counts.
    Engine(&'a Array2<f32>),
}

/// One row with differing values.
struct RowRes {
    i: usize,
    /// Values beyond the bound.
    bad: usize,
    /// The largest `|x - ref|` and the row's `M`.
    err: f64,
    m: f64,
    /// The largest `|x - ref| / M_j`, and its key.
    worst: (f64, usize),
    notes: Vec<String>,
}

/// `|x - ref|` as SPEC 5 ranks values: 0 for the same value (either zero, any NaN, the
/// same infinity), infinite for a non-finite value against anything else.
pub fn abs_error(x: f32, r: f32) -> f64 {
    if x == r || (x.is_nan() && r.is_nan()) {
        0.0
    } else if x.is_finite() && r.is_finite() {
        (x as f64 - r as f64).abs()
    } else {
        f64::INFINITY
    }
}

/// Compare the dump's logits with the replayed ones. Also returns each row's largest
/// `|x - ref|` over its visible keys and the row's `M` (both 0 for a bitwise row).
pub(crate) fn compare_logits(ctx: &Rows, given: Given) -> (Tally, Vec<(f64, f64)>) {
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
    let mut measured = vec![(0.0, 0.0); rows.len()];
    for r in per {
        let s = if r.bad > 0 {
            Status::Different
        } else {
            Status::Tolerant
        };
        d.count(s, ctx.orig[r.i]);
        measured[r.i] = (r.err, r.m);
        d.errors.push(RowError {
            row: ctx.orig[r.i],
            error_log2: r.worst.0.log2(),
            key: r.worst.1,
        });
        for n in r.notes {
            if d.notes.len() < ctx.max_show {
                d.notes.push(n);
            }
        }
    }
    (d, measured)
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
    let exact = ctx.p.class() == Class::Exact;
    let bound = bounds(ctx.p, i);
    let mag = magnitudes(ctx.p, i);
    let mut r = RowRes {
        i,
        bad: 0,
        err: 0.0,
        m: mag.iter().copied().fold(0.0, f64::max),
        worst: (f64::NEG_INFINITY, diff[0]),
        notes: Vec::new(),
    };
    for &j in &diff {
        let e = abs_error(theirs[j], ours[j]);
        let b = if exact { 0.0 } else { bound[j] };
        let ok = e <= b;
        r.bad += usize::from(!ok);
        r.err = r.err.max(e);
        let rel = if e == 0.0 { 0.0 } else { e / mag[j] };
        if rel > r.worst.0 || (rel.is_nan() && !r.worst.0.is_nan()) {
            r.worst = (if rel.is_nan() { f64::INFINITY } else { rel }, j);
        }
        if r.notes.len() < 3 && (!ok || r.notes.is_empty()) {
            r.notes.push(format!(
                "{}, key {j}: given {:e}, reference {:e} (diff {:.4e}, {} M, bound {}){}",
                ctx.label(i),
                theirs[j],
                ours[j],
                theirs[j] as f64 - ours[j] as f64,
                super::tolerance::pow2(rel.log2()),
                if exact {
                    "bitwise (exact class)".to_string()
                } else {
                    format!("{b:.3e}")
                },
                if ok { "" } else { " beyond the bound" }
            ));
        }
    }
    Some(r)
}
