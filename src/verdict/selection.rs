//! SPEC 5's selection rule applied to an expected selection, judged on given scores
//! (the reference's, or an engine's own): how far it is from valid, as the smallest
//! tolerance on the gap to the `K`-th score under which it would be.

use ndarray::Array2;
use rayon::prelude::*;

use super::bound::row_scores;
use super::{RowMargin, Rows, Status, Tally};
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

/// How far `x` lies above `y` under the ranking key, 0 when it does not (equal
/// infinities are equal, so never `inf - inf`).
fn above(x: f32, y: f32) -> f64 {
    let (a, b) = (val(x), val(y));
    if a > b {
        a - b
    } else {
        0.0
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

/// An expected selection under SPEC 5's rule on some scores.
#[derive(Debug, Clone, PartialEq)]
pub struct Judged {
    /// Why no tolerance makes it valid: a wrong count, or items that are not candidates.
    pub structural: Vec<String>,
    /// The tightest tolerance under which it is valid: the most a selected item's score
    /// lies below the `K`-th score, or a left-out candidate's above it. 0: valid up to
    /// exact ties (or every candidate selected).
    pub need: f64,
    /// The `K`-th score, when there are more candidates than `K`.
    pub kth: Option<f32>,
    /// Items on the wrong side of the `K`-th score: (item, gap, whether it is selected),
    /// largest gap first.
    pub offenders: Vec<(usize, f64, bool)>,
}

impl Judged {
    /// Whether it is valid under tolerance `tau` on the gap to the `K`-th score.
    pub fn passes(&self, tau: f64) -> bool {
        self.structural.is_empty() && self.need <= tau
    }

    /// Equal up to ties, within `tau`, or different.
    pub fn status(&self, tau: f64) -> Status {
        if !self.structural.is_empty() {
            Status::Different
        } else if self.need == 0.0 {
            Status::Ties
        } else if self.need <= tau {
            Status::Tolerant
        } else {
            Status::Different
        }
    }

    /// The reasons it fails under `tau` (`what` names an item: `key`, `block`).
    pub fn reasons(&self, scores: &[f32], tau: f64, what: &str) -> Vec<String> {
        let mut why = self.structural.clone();
        let Some(kth) = self.kth else { return why };
        for &(j, gap, selected) in self.offenders.iter().filter(|o| o.1 > tau) {
            why.push(if selected {
                format!(
                    "expected selects {what} {j}: score {:e} lies {gap:.4e} below the K-th score {kth:e} (tolerance {tau:.3e})",
                    scores[j]
                )
            } else {
                format!(
                    "expected leaves out {what} {j}: score {:e} lies {gap:.4e} above the K-th score {kth:e} (tolerance {tau:.3e})",
                    scores[j]
                )
            });
        }
        why
    }
}

/// SPEC 5's rule applied to an expected selection `exp` (a sorted set) of `k` from
/// `cands` (ascending) under `scores`. `what` names an item (`key`, `block`).
pub fn check_selection(
    scores: &[f32],
    cands: &[usize],
    k: usize,
    exp: &[usize],
    what: &str,
) -> Judged {
    let mut structural = Vec::new();
    let want = cands.len().min(k);
    if exp.len() != want {
        structural.push(format!(
            "expected selects {} {what}s, the rule {want}",
            exp.len()
        ));
    }
    for &j in exp {
        if cands.binary_search(&j).is_err() {
            structural.push(format!("expected {what} {j} is not a candidate"));
        }
    }
    let mut out = Judged {
        structural,
        need: 0.0,
        kth: None,
        offenders: Vec::new(),
    };
    if !out.structural.is_empty() || cands.len() <= k {
        return out;
    }
    let kth = kth_score(scores, cands, k);
    out.kth = Some(kth);
    for &j in cands {
        let selected = exp.binary_search(&j).is_ok();
        let gap = if selected {
            above(kth, scores[j])
        } else {
            above(scores[j], kth)
        };
        if gap > 0.0 {
            out.offenders.push((j, gap, selected));
        }
    }
    out.offenders
        .sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    out.need = out.offenders.first().map_or(0.0, |o| o.1);
    out
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

/// One judged row of a selection tensor.
pub(crate) struct RowResult {
    pub i: usize,
    pub status: Status,
    pub margin: RowMargin,
    pub note: String,
}

/// Where a selection is judged: on the reference's scores with the row's tolerance,
/// or on the engine's own logits exactly.
#[derive(Clone, Copy)]
pub(crate) enum Against<'a> {
    /// The reference's scores; tolerance from the context.
    Reference,
    /// The engine's logits `[T, L]`, exact ties only.
    Engine(&'a Array2<f32>),
}

impl Rows<'_, '_> {
    /// Compare selections row by row. `ours` holds the request-local id rows the
    /// selection should be (the replayed ones, or SPEC 5's selection of the engine's
    /// logits), `exp_ids` the expected ones as sets; `same[i]`: the expected row is
    /// bitwise `ours`.
    pub(crate) fn selections(
        &self,
        ours: &Array2<i32>,
        exp_ids: &[Ids],
        same: &[bool],
        against: Against,
    ) -> Tally {
        let mut d = Tally {
            compared: exp_ids.len(),
            ..Default::default()
        };
        let differing: Vec<usize> = (0..exp_ids.len()).filter(|&i| !same[i]).collect();
        let results: Vec<RowResult> = differing
            .par_iter()
            .map(|&i| self.judge_row(ours, &exp_ids[i], i, against))
            .collect();
        for r in results {
            d.count(r.status, self.orig[r.i]);
            d.margins.push(r.margin);
            if d.notes.len() < self.max_show {
                d.notes.push(r.note);
            }
        }
        d
    }

    /// The scores a selection of row `i` is judged on.
    fn scores(&self, i: usize, against: Against) -> Vec<f32> {
        match against {
            Against::Reference => row_scores(self.p, i),
            Against::Engine(m) => {
                let r = self.p.batch.rows()[i];
                m.row(i).iter().skip(r.ks).take(r.n).copied().collect()
            }
        }
    }

    /// Row `i`'s expected selection `exp` under SPEC 5's rule, with its margin and note.
    fn judge_row(&self, ours: &Array2<i32>, exp: &Ids, i: usize, against: Against) -> RowResult {
        let o = parse_row(ours.row(i).as_slice().unwrap_or(&[])).unwrap_or_default();
        let m = self.row_m(i);
        let tau = match against {
            Against::Reference => self.tau(i, m),
            Against::Engine(_) => 0.0,
        };
        let (status, need, note) = match exp {
            Err(why) => (
                Status::Different,
                None,
                format!(
                    "{}: different\n      malformed expected row: {why}",
                    self.label(i)
                ),
            ),
            Ok(e) if *e == o => (
                Status::Ties,
                Some(0.0),
                format!(
                    "{}: the same ids, not in SPEC 5's sorted, -1-padded form",
                    self.label(i)
                ),
            ),
            Ok(e) => {
                let scores = self.scores(i, against);
                let j = check_selection(&scores, &self.cands(i), self.p.topk, e, "key");
                let status = j.status(tau);
                let need = j.structural.is_empty().then_some(j.need);
                let ours_label = match against {
                    Against::Reference => "replayed",
                    Against::Engine(_) => "top-k of engine_logits",
                };
                let note = self.selection_note(&o, e, i, &scores, &j, status, m, tau, ours_label);
                (status, need, note)
            }
        };
        RowResult {
            i,
            status,
            margin: RowMargin::new(self.orig[i], status, need, tau, m),
            note,
        }
    }

    /// The note on differing row `i`: its status and margin, both sets, the keys only
    /// one side selects against the K-th score, and the reasons of a different row.
    #[allow(clippy::too_many_arguments)]
    fn selection_note(
        &self,
        o: &[usize],
        e: &[usize],
        i: usize,
        scores: &[f32],
        j: &Judged,
        status: Status,
        m: f64,
        tau: f64,
        ours_label: &str,
    ) -> String {
        let margin = RowMargin::new(
            self.orig[i],
            status,
            j.structural.is_empty().then_some(j.need),
            tau,
            m,
        );
        let mut s = format!(
            "{}: {status}{}\n      expected: {}\n      {ours_label}: {}",
            self.label(i),
            margin.describe(),
            abbrev(e, self.verbose),
            abbrev(o, self.verbose),
        );
        let kth = kth_score(scores, &self.cands(i), self.p.topk);
        let only_ours = format!("only {ours_label}");
        for (label, set) in [
            ("only expected", minus(e, o)),
            (only_ours.as_str(), minus(o, e)),
        ] {
            for &k in set.iter().take(8) {
                let sc = scores.get(k).copied().unwrap_or(f32::NAN);
                s += &format!(
                    "\n      {label}: key {k} score {sc:e} vs K-th score {kth:e} (diff {:.4e}, tolerance {tau:.3e})",
                    sc as f64 - kth as f64
                );
            }
        }
        if status == Status::Different {
            for w in j.reasons(scores, tau, "key").iter().take(4) {
                s += &format!("\n      {w}");
            }
        }
        s
    }
}
