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

use ndarray::Array2;
use serde::Serialize;

use crate::dump::Expected;
use crate::error::{Error, Result};
use crate::problem::{Problem, Role};
use crate::reference::{candidates, Output};

pub use report::{class_name, human_bytes, Layer, ReplayReport, RowReport, Seconds};

/// How one tensor, or the whole dump, compares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub enum Status {
    /// The dump carries no expected output to compare.
    #[serde(rename = "no expected outputs")]
    NoExpected,
    /// Bitwise the reference's outputs.
    #[serde(rename = "identical")]
    Identical,
    /// Differing only within ties and the tolerance bound.
    #[serde(rename = "equal up to ties and tolerance")]
    Tolerant,
    /// Really different.
    #[serde(rename = "different")]
    Different,
}

impl Status {
    /// The words of the verdict (`identical`, `equal up to ties and tolerance`, ...).
    pub fn as_str(&self) -> &'static str {
        match self {
            Status::NoExpected => "no expected outputs",
            Status::Identical => "identical",
            Status::Tolerant => "equal up to ties and tolerance",
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

/// How one tensor compares.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TensorVerdict {
    /// The tensor (`ks`, `ke`, `raw`, `page`, `published`, `logits`, `engine_logits`).
    #[serde(skip)]
    pub name: &'static str,
    /// Identical, equal up to ties and tolerance, or different.
    pub status: Status,
    /// Rows compared.
    pub compared_rows: usize,
    /// Rows differing only within ties and the tolerance bound.
    pub rows_tolerant: usize,
    /// Rows really different.
    pub rows_different: usize,
    /// The first different row, in the caller's row numbering.
    pub first_different_row: Option<usize>,
    /// Notes on the first differing rows, at most [`Options::max_notes`].
    pub notes: Vec<String>,
}

/// The verdict on a whole dump: each tensor it carries, and the worst of them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Verdict {
    /// The worst tensor status; [`Status::NoExpected`] when there is no tensor.
    #[serde(rename = "verdict")]
    pub status: Status,
    /// The tensors compared, in the order `ks`, `ke`, `raw`, `page`, `published`,
    /// `logits`, `engine_logits` (those the dump carries).
    #[serde(serialize_with = "report::tensor_map")]
    pub tensors: Vec<TensorVerdict>,
}

impl Verdict {
    fn of(tensors: Vec<TensorVerdict>) -> Verdict {
        let status = tensors
            .iter()
            .map(|t| t.status)
            .max()
            .unwrap_or(Status::NoExpected);
        Verdict { status, tensors }
    }

    /// The tensor called `name`, if the dump carried it.
    pub fn tensor(&self, name: &str) -> Option<&TensorVerdict> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

/// What the judge reports beyond the counts.
#[derive(Debug, Clone, Copy)]
pub struct Options<'r> {
    /// The caller's number of each row of the problem (for a replay of selected rows:
    /// their numbers in the full dump); `None`: `0..T`.
    pub row_numbers: Option<&'r [usize]>,
    /// Notes kept per tensor.
    pub max_notes: usize,
    /// Print index sets in full rather than abbreviated.
    pub full_ids: bool,
}

impl Default for Options<'_> {
    fn default() -> Self {
        Options {
            row_numbers: None,
            max_notes: 5,
            full_ids: false,
        }
    }
}

/// Judge the expected tensors of a dump (`expected`, and the engine's own logits
/// `engine_logits [T, L]` if it carries them) against `replayed`, the outputs of the
/// dump's problem `p` on the reference or a backend bitwise equal to it.
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
    let ctx = Rows {
        p,
        orig,
        max_show: opts.max_notes,
        verbose: opts.full_ids,
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
    let raw_ids: Option<Vec<selection::Ids>> = e.raw.as_ref().map(|raw| {
        raw.rows()
            .into_iter()
            .map(|r| selection::parse_row(r.as_slice().unwrap_or(&[])))
            .collect()
    });
    if let (Some(ids), Some(raw)) = (&raw_ids, &e.raw) {
        let same = same_rows(raw, &replayed.raw);
        tensors.push(ctx.selections(&replayed.raw, ids, &same).finish("raw"));
    }
    if let Some(pg) = &e.page {
        let d = match &raw_ids {
            // The page of a valid selection is its slots: compare it with the slots of
            // the expected raw row; the selection itself was judged on `raw`.
            Some(ids) => page::page_vs_raw(&ctx, ids, pg),
            None => {
                let ids = page::ids_from_page(p, pg);
                ctx.selections(&replayed.raw, &ids, &same_rows(pg, &replayed.page))
            }
        };
        tensors.push(d.finish("page"));
    }
    if let Some(pb) = &e.published {
        let rows: Vec<usize> = e
            .published_rows
            .as_ref()
            .map(|v| v.iter().map(|&x| x as usize).collect())
            .unwrap_or_else(|| (0..t).filter(|&i| p.publishes(i)).collect());
        let d = published::compare_published(&ctx, replayed, pb, &rows);
        tensors.push(d.finish("published"));
    }
    if let Some(l) = &e.logits {
        let d = logits::compare_logits(&ctx, logits::Given::Flat(l));
        tensors.push(d.finish("logits"));
    }
    if let Some(m) = engine_logits {
        let d = logits::compare_logits(&ctx, logits::Given::Engine(m));
        tensors.push(d.finish("engine_logits"));
    }
    Ok(Verdict::of(tensors))
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
    /// Differing only within ties / the tolerance bound.
    pub tolerant: usize,
    /// Really different.
    pub different: usize,
    /// Notes on the first differing rows.
    pub notes: Vec<String>,
    /// First different row (caller's numbering).
    pub first_row: Option<usize>,
}

impl Tally {
    fn finish(self, name: &'static str) -> TensorVerdict {
        let status = if self.different > 0 {
            Status::Different
        } else if self.tolerant > 0 {
            Status::Tolerant
        } else {
            Status::Identical
        };
        TensorVerdict {
            name,
            status,
            compared_rows: self.compared,
            rows_tolerant: self.tolerant,
            rows_different: self.different,
            first_different_row: self.first_row,
            notes: self.notes,
        }
    }

    /// Count row `orig` as different (`bad`) or tolerant.
    pub fn count(&mut self, bad: bool, orig: usize) {
        if bad {
            self.different += 1;
            self.first_row.get_or_insert(orig);
        } else {
            self.tolerant += 1;
        }
    }
}

/// Everything the comparisons need about a row beyond the problem.
pub(crate) struct Rows<'a, 'p> {
    pub p: &'a Problem<'p>,
    /// The caller's number of each row.
    pub orig: &'a [usize],
    pub max_show: usize,
    pub verbose: bool,
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

    /// `ks` / `ke` row by row: equal or different.
    fn exact_rows(&self, name: &str, ours: &[i32], theirs: &[i32]) -> Tally {
        let mut d = Tally {
            compared: theirs.len(),
            ..Default::default()
        };
        for (i, (a, b)) in ours.iter().zip(theirs).enumerate() {
            if a != b {
                d.count(true, self.orig[i]);
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
