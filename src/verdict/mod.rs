//! SPEC 9's verdict: an engine's dumped outputs judged against the reference.
//!
//! [`judge`] compares the expected tensors a [`Dump`](crate::dump::Dump) carries (or an
//! engine's own logits) with the outputs of the same problem replayed on the reference
//! (or on any backend bitwise equal to it), tensor by tensor:
//!
//! - `ks`, `ke`: equal or different;
//! - `raw`: each row a valid selection of SPEC 5 up to ties and SPEC 4's bound, judged
//!   on the reference's scores ([`selection`]); an unordered or differently padded row
//!   of the same ids is equal up to order;
//! - `page`: the slots of the expected `raw` ids ([`page`]), or, without `raw`, the
//!   selection those slots name;
//! - `published`: SPEC 6's blocks up to ties and the bound ([`published`]);
//! - `logits`, `engine_logits`: every value within SPEC 4's bound of the reference
//!   ([`bound`], [`logits`]).
//!
//! A tensor is *identical*, *equal up to ties and tolerance*, or *different*; the
//! [`Verdict`] is the worst of them. [`ReplayReport`] wraps a verdict with the layer's
//! shape and the replay's timings, and prints the same value as text ([`Display`]) and
//! as JSON ([`serde::Serialize`]).
//!
//! [`Display`]: std::fmt::Display

pub mod bound;
pub mod logits;
pub mod page;
pub mod published;
pub mod report;
pub mod selection;
mod tolerance;

use ndarray::Array2;
use serde::Serialize;

use crate::dump::Expected;
use crate::error::{Error, Result};
use crate::problem::{Problem, Role};
use crate::reference::{candidates, Output};

pub use report::{class_name, human_bytes, Layer, PagedPool, ReplayReport, RowReport, Seconds};
pub use tolerance::{
    Applied, MarginSummary, RowError, RowMargin, Tolerance, DEFAULT_TOLERANCE_LOG2,
};

/// How one tensor, or the whole dump, compares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub enum Status {
    /// The dump carries no expected output to compare.
    #[serde(rename = "no expected outputs")]
    NoExpected,
    /// Bitwise the reference's outputs.
    #[serde(rename = "identical")]
    Identical,
    /// The same selections up to the order of exactly tied keys (or of a row's ids).
    #[serde(rename = "equal up to ties")]
    Ties,
    /// Differing only within the applied tolerance (logits: within SPEC 4's bound).
    #[serde(rename = "equal within tolerance")]
    Tolerant,
    /// Really different.
    #[serde(rename = "different")]
    Different,
}

impl Status {
    /// The words of the verdict (`identical`, `equal up to ties`, ...).
    pub fn as_str(&self) -> &'static str {
        match self {
            Status::NoExpected => "no expected outputs",
            Status::Identical => "identical",
            Status::Ties => "equal up to ties",
            Status::Tolerant => "equal within tolerance",
            Status::Different => "different",
        }
    }

    /// The replay's exit code: 1 when different, else 0.
    pub fn exit_code(&self) -> i32 {
        i32::from(*self == Status::Different)
    }
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How one tensor (or one part of the judgement) compares.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TensorVerdict {
    /// The part (`ks`, `ke`, `raw`, `page`, `published`, `logits`, `engine_logits`,
    /// `engine_topk`).
    #[serde(skip)]
    pub name: &'static str,
    /// Identical, equal up to ties, equal within tolerance, or different.
    pub status: Status,
    /// Rows compared.
    pub compared_rows: usize,
    /// Rows equal only up to ties (or the order of their ids).
    pub rows_ties: usize,
    /// Rows differing only within the tolerance.
    pub rows_tolerant: usize,
    /// Rows really different.
    pub rows_different: usize,
    /// The first different row, in the caller's row numbering.
    pub first_different_row: Option<usize>,
    /// What the selections were judged with (selection parts only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tolerance: Option<Applied>,
    /// Every differing row's margin (selection parts only), in row order.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub margins: Vec<RowMargin>,
    /// The distribution of the margins (selection parts with a differing row).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub margin_summary: Option<MarginSummary>,
    /// Logit parts: the worst `|x - ref| / M` as `log2` (`None`: bitwise equal).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub worst_error_log2: Option<f64>,
    /// Logit parts: the rows with the largest `|x - ref| / M`, worst first.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub worst_rows: Vec<RowError>,
    /// Notes on the first differing rows, at most [`Options::max_notes`].
    pub notes: Vec<String>,
}

/// The verdict on a whole dump: each tensor it carries, and the worst of them.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Verdict {
    /// The worst tensor status; [`Status::NoExpected`] when there is no tensor.
    #[serde(rename = "verdict")]
    pub status: Status,
    /// The tolerance the selections were judged with, and why.
    pub tolerance: Applied,
    /// The parts compared, in the order `ks`, `ke`, `raw`, `page`, `published`,
    /// `logits`, `engine_logits`, `engine_topk` (those the dump carries).
    #[serde(serialize_with = "report::tensor_map")]
    pub tensors: Vec<TensorVerdict>,
}

impl Verdict {
    fn of(tensors: Vec<TensorVerdict>, tolerance: Applied) -> Verdict {
        let status = tensors
            .iter()
            .map(|t| t.status)
            .max()
            .unwrap_or(Status::NoExpected);
        Verdict {
            status,
            tolerance,
            tensors,
        }
    }

    /// The tensor called `name`, if the dump carried it.
    pub fn tensor(&self, name: &str) -> Option<&TensorVerdict> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

/// How the judge works and what it reports beyond the counts.
#[derive(Debug, Clone, Copy)]
pub struct Options<'r> {
    /// The caller's number of each row of the problem (for a replay of selected rows:
    /// their numbers in the full dump); `None`: `0..T`.
    pub row_numbers: Option<&'r [usize]>,
    /// Notes kept per tensor.
    pub max_notes: usize,
    /// Print index sets in full rather than abbreviated.
    pub full_ids: bool,
    /// The tolerance of the selections (SPEC 9): [`Tolerance::Auto`] measures it from
    /// the engine's logits, or applies the class's default without them.
    pub tolerance: Tolerance,
}

impl Default for Options<'_> {
    fn default() -> Self {
        Options {
            row_numbers: None,
            max_notes: 5,
            full_ids: false,
            tolerance: Tolerance::Auto,
        }
    }
}

/// Judge the expected tensors of a dump (`expected`, and the engine's own logits
/// `engine_logits [T, L]` if it carries them) against `replayed`, the outputs of the
/// dump's problem `p` on the reference or a backend bitwise equal to it (SPEC 9).
///
/// With `engine_logits` the judgement is decomposed: the logits against SPEC 4's class
/// bound (`engine_logits`), the selections against SPEC 5's selection of the engine's
/// own logits, exactly (`engine_topk`), and the selections against the reference with
/// each row's measured error as the tolerance (`raw`, `page`, `published`). Without
/// them the selections get [`Options::tolerance`] (by default the class's).
///
/// Errors ([`Error::Dump`], naming the tensor) when an expected tensor's shape does not
/// fit `p`, or when `row_numbers` does not have one entry per row.
pub fn judge(
    p: &Problem,
    replayed: &Output,
    expected: &Expected,
    engine_logits: Option<&Array2<f32>>,
    opts: &Options,
) -> Result<Verdict> {
    check_shapes(p, expected, engine_logits)?;
    let t = p.batch.num_rows();
    let identity: Vec<usize>;
    let orig = match opts.row_numbers {
        Some(r) if r.len() == t => r,
        Some(r) => {
            return Err(Error::shape("row_numbers", &[r.len()], &[t]));
        }
        None => {
            identity = (0..t).collect();
            &identity
        }
    };
    let mut ctx = Rows {
        p,
        orig,
        max_show: opts.max_notes,
        verbose: opts.full_ids,
        tol: RowTol::Ties,
        default_log2: tolerance::default_log2(p.class()),
    };
    let e = expected;
    let mut tensors = Vec::new();
    if let Some(v) = &e.ks {
        let ks: Vec<i32> = p.batch.rows().iter().map(|r| r.ks as i32).collect();
        tensors.push(ctx.exact_rows("ks", &ks, v).finish("ks"));
    }
    if let Some(v) = &e.ke {
        let ke: Vec<i32> = p.batch.rows().iter().map(|r| r.ke() as i32).collect();
        tensors.push(ctx.exact_rows("ke", &ke, v).finish("ke"));
    }
    // Part 1: the engine's logits against the class's bound, and their error per row.
    let mut engine_part = None;
    let mut measured = None;
    if let Some(m) = engine_logits {
        let (d, err) = logits::compare_logits(&ctx, logits::Given::Engine(m));
        engine_part = Some(d.finish("engine_logits"));
        measured = Some(err);
    }
    let (tol, applied) = tolerance::resolve(opts.tolerance, p.class(), measured);
    ctx.tol = tol;
    let raw_ids: Option<Vec<selection::Ids>> = e.raw.as_ref().map(|raw| {
        raw.rows()
            .into_iter()
            .map(|r| selection::parse_row(r.as_slice().unwrap_or(&[])))
            .collect()
    });
    let page_ids: Option<Vec<selection::Ids>> = match (&raw_ids, &e.page) {
        (None, Some(pg)) => Some(page::ids_from_page(p, pg)),
        _ => None,
    };
    let against = selection::Against::Reference;
    if let (Some(ids), Some(raw)) = (&raw_ids, &e.raw) {
        let same = same_rows(raw, &replayed.raw);
        let d = ctx.selections(&replayed.raw, ids, &same, against);
        tensors.push(d.finish_with("raw", &ctx, &applied));
    }
    if let Some(pg) = &e.page {
        let d = match &raw_ids {
            // The page of a valid selection is its slots: compare it with the slots of
            // the expected raw row; the selection itself was judged on `raw`.
            Some(ids) => page::page_vs_raw(&ctx, ids, pg).finish("page"),
            None => {
                let ids = page_ids.as_deref().unwrap_or_default();
                ctx.selections(&replayed.raw, ids, &same_rows(pg, &replayed.page), against)
                    .finish_with("page", &ctx, &applied)
            }
        };
        tensors.push(d);
    }
    if let Some(pb) = &e.published {
        let rows: Vec<usize> = e
            .published_rows
            .as_ref()
            .map(|v| v.iter().map(|&x| x as usize).collect())
            .unwrap_or_else(|| (0..t).filter(|&i| p.publishes(i)).collect());
        let d = published::compare_published(&ctx, replayed, pb, &rows);
        tensors.push(d.finish_with("published", &ctx, &applied));
    }
    if let Some(l) = &e.logits {
        let (d, _) = logits::compare_logits(&ctx, logits::Given::Flat(l));
        tensors.push(d.finish("logits"));
    }
    if let Some(d) = engine_part {
        tensors.push(d);
    }
    // Part 2: the engine's selections are SPEC 5's selection of its own logits.
    if let (Some(m), Some(ids)) = (engine_logits, raw_ids.as_ref().or(page_ids.as_ref())) {
        let own = engine_topk(p, m);
        let same: Vec<bool> = match &e.raw {
            Some(raw) => same_rows(raw, &own),
            None => vec![false; t],
        };
        let d = ctx.selections(&own, ids, &same, selection::Against::Engine(m));
        tensors.push(d.finish_with("engine_topk", &ctx, &tolerance::exact_ties()));
    }
    Ok(Verdict::of(tensors, applied))
}

/// SPEC 5's selection (`raw` form) of each row from the engine's logits `m [T, L]`.
fn engine_topk(p: &Problem, m: &Array2<f32>) -> Array2<i32> {
    let t = p.batch.num_rows();
    let mut out = Array2::from_elem((t, p.topk), -1i32);
    for i in 0..t {
        let r = p.batch.rows()[i];
        let s: Vec<f32> = m.row(i).iter().skip(r.ks).take(r.n).copied().collect();
        let sel = crate::reference::topk::select_by_sort(&s, &row_candidates(p, i), p.topk);
        for (c, &j) in sel.iter().enumerate() {
            out[[i, c]] = j;
        }
    }
    out
}

/// The shapes of the expected tensors (and of the engine's logits) against `p`.
pub fn check_shapes(p: &Problem, e: &Expected, engine_logits: Option<&Array2<f32>>) -> Result<()> {
    let bad = |tensor: &str, problem: String| Error::Dump {
        tensor: tensor.into(),
        problem,
    };
    let t = p.batch.num_rows();
    for (name, arr, w) in [
        ("expected_raw", &e.raw, p.topk),
        ("expected_page", &e.page, p.page_cols),
    ] {
        if let Some(a) = arr {
            if a.nrows() != t || a.ncols() != w {
                return Err(bad(
                    name,
                    format!("shape {:?}, expected [{t}, {w}]", a.shape()),
                ));
            }
        }
    }
    for (name, v) in [("expected_ks", &e.ks), ("expected_ke", &e.ke)] {
        if let Some(v) = v {
            if v.len() != t {
                return Err(bad(name, format!("shape [{}], expected [{t}]", v.len())));
            }
        }
    }
    if let Some(l) = &e.logits {
        if l.len() != p.batch.valid_pairs() {
            return Err(bad(
                "expected_logits",
                format!(
                    "shape [{}], expected [{}] (sum n)",
                    l.len(),
                    p.batch.valid_pairs()
                ),
            ));
        }
    }
    if let Some(m) = engine_logits {
        if m.shape() != [t, p.batch.num_keys()] {
            return Err(bad(
                "engine_logits",
                format!(
                    "shape {:?}, expected [{t}, {}]",
                    m.shape(),
                    p.batch.num_keys()
                ),
            ));
        }
    }
    if let (Some(pb), Some(pr)) = (&e.published, &e.published_rows) {
        if pb.nrows() != pr.len() {
            return Err(bad(
                "expected_published_rows",
                format!(
                    "shape [{}], expected [{}] (rows of expected_published)",
                    pr.len(),
                    pb.nrows()
                ),
            ));
        }
        if let Some(&r) = pr.iter().find(|&&r| r < 0 || r as usize >= t) {
            return Err(bad(
                "expected_published_rows",
                format!("row {r} outside 0..{t}"),
            ));
        }
    }
    Ok(())
}

/// Whether each row of `a` is bitwise the same row of `b`.
fn same_rows(a: &Array2<i32>, b: &Array2<i32>) -> Vec<bool> {
    a.rows()
        .into_iter()
        .zip(b.rows())
        .map(|(x, y)| x == y)
        .collect()
}

/// One tensor's counts while it is judged.
#[derive(Debug, Default, Clone)]
pub(crate) struct Tally {
    /// Rows compared.
    pub compared: usize,
    /// Equal only up to ties.
    pub ties: usize,
    /// Differing only within the tolerance.
    pub tolerant: usize,
    /// Really different.
    pub different: usize,
    /// Notes on the first differing rows.
    pub notes: Vec<String>,
    /// First different row (caller's numbering).
    pub first_row: Option<usize>,
    /// Margins of the differing rows (selection parts).
    pub margins: Vec<RowMargin>,
    /// Logit parts: the worst error per differing row.
    pub errors: Vec<RowError>,
}

impl Tally {
    fn finish(self, name: &'static str) -> TensorVerdict {
        let status = if self.different > 0 {
            Status::Different
        } else if self.tolerant > 0 {
            Status::Tolerant
        } else if self.ties > 0 {
            Status::Ties
        } else {
            Status::Identical
        };
        let mut errors = self.errors;
        errors.sort_by(|a, b| {
            b.error_log2
                .total_cmp(&a.error_log2)
                .then(a.row.cmp(&b.row))
        });
        let worst_error_log2 = errors.first().map(|e| e.error_log2);
        errors.truncate(5);
        TensorVerdict {
            name,
            status,
            compared_rows: self.compared,
            rows_ties: self.ties,
            rows_tolerant: self.tolerant,
            rows_different: self.different,
            first_different_row: self.first_row,
            tolerance: None,
            margins: Vec::new(),
            margin_summary: None,
            worst_error_log2,
            worst_rows: errors,
            notes: self.notes,
        }
    }

    /// A selection part: also the tolerance it was judged with and its margins.
    fn finish_with(self, name: &'static str, ctx: &Rows, applied: &Applied) -> TensorVerdict {
        let mut margins = self.margins.clone();
        margins.sort_by_key(|m| m.row);
        let summary = MarginSummary::of(&margins, ctx.default_log2);
        let mut v = self.finish(name);
        v.tolerance = Some(applied.clone());
        v.margin_summary = summary;
        v.margins = margins;
        v
    }

    /// Count row `orig` with its status.
    pub fn count(&mut self, s: Status, orig: usize) {
        match s {
            Status::Different => {
                self.different += 1;
                self.first_row.get_or_insert(orig);
            }
            Status::Tolerant => self.tolerant += 1,
            Status::Ties => self.ties += 1,
            Status::Identical | Status::NoExpected => {}
        }
    }
}

/// The tolerance of each row's selection, on the gap to its `K`-th score.
#[derive(Debug, Clone)]
pub(crate) enum RowTol {
    /// Exact ties only.
    Ties,
    /// `2^x * M_i`.
    Relative(f64),
    /// Given per row (twice the row's measured logit error).
    Measured(Vec<f64>),
}

/// Everything the comparisons need about a row beyond the problem.
pub(crate) struct Rows<'a, 'p> {
    pub p: &'a Problem<'p>,
    /// The caller's number of each row.
    pub orig: &'a [usize],
    pub max_show: usize,
    pub verbose: bool,
    /// The selections' tolerance.
    pub tol: RowTol,
    /// The class's default tolerance for engine dumps, `log2` of its factor of `M`
    /// (`None`: exact ties only).
    pub default_log2: Option<f64>,
}

impl Rows<'_, '_> {
    /// Row `i`'s candidate keys (request-local, ascending): every visible key, or a
    /// consumer's keys in its given blocks.
    pub fn cands(&self, i: usize) -> Vec<usize> {
        row_candidates(self.p, i)
    }

    /// `row 7 (request 0, position 12, 13 visible keys)`.
    pub fn label(&self, i: usize) -> String {
        row_label(self.p, i, self.orig[i])
    }

    /// Row `i`'s `M`: the largest SPEC 4 magnitude over its visible keys.
    pub fn row_m(&self, i: usize) -> f64 {
        bound::row_magnitude(self.p, i)
    }

    /// Row `i`'s tolerance on the gap to its `K`-th score, given its `M`.
    pub fn tau(&self, i: usize, m: f64) -> f64 {
        match &self.tol {
            RowTol::Ties => 0.0,
            RowTol::Relative(x) => x.exp2() * m,
            RowTol::Measured(v) => v[i],
        }
    }

    /// `ks` / `ke` row by row: equal or different.
    fn exact_rows(&self, name: &str, ours: &[i32], theirs: &[i32]) -> Tally {
        let mut d = Tally {
            compared: theirs.len(),
            ..Default::default()
        };
        for (i, (a, b)) in ours.iter().zip(theirs).enumerate() {
            if a != b {
                d.count(Status::Different, self.orig[i]);
                if d.notes.len() < self.max_show {
                    d.notes.push(format!(
                        "{}: {name} expected {:?}, replayed {:?}",
                        self.label(i),
                        [*b],
                        [*a]
                    ));
                }
            }
        }
        d
    }
}

/// Row `i`'s candidate keys (request-local, ascending): every visible key, or a
/// consumer's keys in its given blocks.
pub fn row_candidates(p: &Problem, i: usize) -> Vec<usize> {
    let n = p.batch.rows()[i].n;
    match p.role {
        Role::Consumer(c) => {
            let b = c.blocks.row(i);
            candidates::consumer_candidates(b.as_slice().unwrap_or(&[]), n, p.block_size).collect()
        }
        _ => (0..n).collect(),
    }
}

/// `row 7 (request 0, position 12, 13 visible keys)`: row `i` of `p`, numbered `number`.
pub fn row_label(p: &Problem, i: usize, number: usize) -> String {
    let r = p.batch.rows()[i];
    format!(
        "row {} (request {}, position {}, {} visible keys)",
        number, r.request, r.position, r.n
    )
}

#[cfg(test)]
mod tests;
