//! SPEC 5's selection rule applied to an expected selection: valid up to ties and the
//! tolerance bound, judged on the reference's scores.

use ndarray::Array2;
use rayon::prelude::*;

use super::bound::{row_bound, row_scores};
use super::{Rows, Tally};
use crate::reference::rank_key;

/// A row's ids as a sorted set, or why the row is malformed.
pub type Ids = std::result::Result<Vec<usize>, String>;

/// A score as a comparable f64: NaN is -inf (SPEC 5); -0.0 compares equal to +0.0.
fn val(x: f32) -> f64 {
    if x.is_nan() {
        f64::NEG_INFINITY
    } else {
        x as f64
    }
}

/// The `k`-th best score among `cands` under the ranking key (NaN when there is none).
pub fn kth_score(scores: &[f32], cands: &[usize], k: usize) -> f32 {
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
pub fn parse_row(row: &[i32]) -> Ids {
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
/// otherwise the reasons. `what` names an item (`key`, `block`).
pub fn check_selection(
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

/// `a` abbreviated to its first and last few entries, unless `full`.
pub fn abbrev(a: &[usize], full: bool) -> String {
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

impl Rows<'_, '_> {
    /// Compare selections row by row. `ours` holds the replayed request-local id rows,
    /// `exp_ids` the expected ones as sets; `same[i]`: the expected row is bitwise the
    /// replayed one.
    pub(crate) fn selections(&self, ours: &Array2<i32>, exp_ids: &[Ids], same: &[bool]) -> Tally {
        let mut d = Tally {
            compared: exp_ids.len(),
            ..Default::default()
        };
        let differing: Vec<usize> = (0..exp_ids.len()).filter(|&i| !same[i]).collect();
        let results: Vec<(usize, std::result::Result<(), Vec<String>>)> = differing
            .par_iter()
            .map(|&i| (i, self.judge_row(ours, &exp_ids[i], i)))
            .collect();
        for (i, r) in results {
            d.count(r.is_err(), self.orig[i]);
            if d.notes.len() < self.max_show {
                d.notes.push(self.selection_note(ours, &exp_ids[i], i, &r));
            }
        }
        d
    }

    /// Row `i`'s expected selection `exp` under SPEC 5's rule.
    fn judge_row(
        &self,
        ours: &Array2<i32>,
        exp: &Ids,
        i: usize,
    ) -> std::result::Result<(), Vec<String>> {
        let exp = match exp {
            Ok(e) => e,
            Err(why) => return Err(vec![format!("malformed expected row: {why}")]),
        };
        let o = parse_row(ours.row(i).as_slice().unwrap_or(&[])).unwrap_or_default();
        if *exp == o {
            // The same ids, in another order or padding: no selection differs.
            return Ok(());
        }
        let scores = row_scores(self.p, i);
        let bound = row_bound(self.p, i);
        check_selection(&scores, &self.cands(i), self.p.topk, exp, bound, "key")
    }

    /// The note on differing row `i`: both sets, the keys only one side selects against
    /// the K-th score, and the reasons of a different row.
    fn selection_note(
        &self,
        ours: &Array2<i32>,
        exp: &Ids,
        i: usize,
        r: &std::result::Result<(), Vec<String>>,
    ) -> String {
        let p = self.p;
        let bad = r.is_err();
        let o = parse_row(ours.row(i).as_slice().unwrap_or(&[])).unwrap_or_default();
        let e = exp.clone().unwrap_or_default();
        if e == o && !bad {
            return format!(
                "{}: the same ids, not in SPEC 5's sorted, -1-padded form",
                self.label(i)
            );
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
        let kth = kth_score(&scores, &cands, p.topk);
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
        if let Err(why) = r {
            for w in why.iter().take(4) {
                s += &format!("\n      {w}");
            }
        }
        s
    }
}
