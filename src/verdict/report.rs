//! A replay's report: the layer, the timings and the [`Verdict`], as
//! text ([`Display`](std::fmt::Display)) and as JSON ([`Serialize`]) from one value.

use std::fmt;

use serde::ser::SerializeMap;
use serde::{Serialize, Serializer};

use super::bound::{row_magnitude, row_scores};
use super::selection::{abbrev, kth_score, parse_row};
use super::tolerance::pow2;
use super::{row_candidates, row_label, Status, TensorVerdict, Verdict};
use crate::dump::Expected;
use crate::error::{Error, Result};
use crate::problem::{Class, Problem};
use crate::reference::{rank_key, Output};

/// The shape of a layer-forward, as a report states it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Layer {
    /// Query rows `T`.
    pub rows: usize,
    /// Keys `L` of the flat buffer.
    pub keys: usize,
    /// `H`.
    pub heads: usize,
    /// `D`.
    pub dim: usize,
    /// `K`.
    pub topk: usize,
    /// `r`.
    pub ratio: usize,
    /// `e4m3` or `e2m1`.
    pub q_format: String,
    /// `e4m3` or `e2m1`.
    pub k_format: String,
    /// `exact` or `tolerance`.
    pub class: &'static str,
    /// `plain`, `source` or `consumer`.
    pub role: &'static str,
    /// Paged keys (SPEC 10): the pool's shape; `None` (and absent from the JSON) for
    /// flat keys.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub paged: Option<PagedPool>,
}

/// A paged layer's pool, as a report states it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PagedPool {
    /// `P`: tokens per page.
    pub page_size: usize,
    /// Pages in the pool (used or not).
    pub pages: usize,
}

impl Layer {
    /// The shape of problem `p`.
    pub fn of(p: &Problem) -> Layer {
        Layer {
            rows: p.batch.num_rows(),
            keys: p.batch.num_keys(),
            heads: p.heads,
            dim: p.dim,
            topk: p.topk,
            ratio: p.batch.ratio(),
            q_format: p.q_format().to_string(),
            k_format: p.k_format().to_string(),
            class: class_name(p.class()),
            role: p.role.name(),
            paged: p.paged().map(|pk| PagedPool {
                page_size: pk.page_size,
                pages: pk.num_pages(),
            }),
        }
    }
}

/// `exact` or `tolerance`.
pub fn class_name(c: Class) -> &'static str {
    match c {
        Class::Exact => "exact",
        Class::Tolerance => "tolerance",
    }
}

/// Wall-clock seconds of a replay's three steps.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Seconds {
    /// Reading the dump and building the problem.
    pub parse: f64,
    /// Running the problem.
    pub run: f64,
    /// Judging the outputs.
    pub diff: f64,
}

/// What a replay of a dump found. Its text is [`Display`](fmt::Display), its JSON is
/// [`Serialize`]: the JSON object holds `file`, `verdict`, the [`Layer`]'s fields,
/// `device`, `seconds` and `tensors` (name -> [`TensorVerdict`]); `partial`,
/// `device_detail` and `budget` appear in the text only.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplayReport {
    /// The dump's file name as given.
    pub file: String,
    /// Whether only some of the dump's rows were replayed.
    #[serde(skip)]
    pub partial: bool,
    /// The replayed layer.
    #[serde(flatten)]
    pub layer: Layer,
    /// Where the problem ran (`cpu`, `cuda`).
    pub device: String,
    /// The device in words, for the text (`cpu (avx2, 8 threads)`).
    #[serde(skip)]
    pub device_detail: String,
    /// Logits budget of the run, bytes.
    #[serde(skip)]
    pub budget: usize,
    /// Timings.
    pub seconds: Seconds,
    /// The verdict and its tensors.
    #[serde(flatten)]
    pub verdict: Verdict,
}

impl ReplayReport {
    /// The replay's exit code: 0 identical, equal up to ties or equal within tolerance
    /// (or nothing to compare), 1 different.
    pub fn exit_code(&self) -> i32 {
        self.verdict.status.exit_code()
    }
}

impl fmt::Display for ReplayReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let l = &self.layer;
        writeln!(
            f,
            "replay {}: {} rows{}, {} keys{}, H={} D={} K={} ratio {}, {} x {} ({} class), {}",
            self.file,
            l.rows,
            if self.partial { " (selected)" } else { "" },
            l.keys,
            match l.paged {
                Some(pp) => format!(" (paged: {} pages of {})", pp.pages, pp.page_size),
                None => String::new(),
            },
            l.heads,
            l.dim,
            l.topk,
            l.ratio,
            l.q_format,
            l.k_format,
            l.class,
            l.role
        )?;
        let s = &self.seconds;
        writeln!(
            f,
            "  parse {:.2} s, run {:.2} s on {} (budget {}), diff {:.2} s",
            s.parse,
            s.run,
            self.device_detail,
            human_bytes(self.budget as u128),
            s.diff
        )?;
        for t in &self.verdict.tensors {
            write!(f, "{t}")?;
        }
        let v = &self.verdict;
        if v.tensors.iter().any(|t| t.tolerance.is_some()) {
            writeln!(f, "  tolerance      {}", v.tolerance)?;
        }
        if v.status == Status::Tolerant {
            // Name what the tolerance was: the selections', or only SPEC 4's bound.
            let selections = v
                .tensors
                .iter()
                .any(|t| t.status == Status::Tolerant && t.tolerance.is_some());
            let named = if selections {
                v.tolerance.rule.clone()
            } else {
                "SPEC 4's bound on logits".into()
            };
            writeln!(f, "verdict: {} ({named})", v.status)
        } else {
            writeln!(f, "verdict: {}", v.status)
        }
    }
}

/// One line of counts, then the notes, each on its own indented line.
impl fmt::Display for TensorVerdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.name;
        let what = if n == "logits" || n == "engine_logits" {
            "rows with differing values"
        } else {
            "rows differ"
        };
        let differing = self.rows_different + self.rows_tolerant + self.rows_ties;
        if differing == 0 {
            writeln!(f, "  {n:<14} identical ({} rows)", self.compared_rows)?;
        } else {
            writeln!(
                f,
                "  {n:<14} {}: {differing} of {} {what} ({} up to ties, {} within tolerance, {} beyond)",
                self.status,
                self.compared_rows,
                self.rows_ties,
                self.rows_tolerant,
                self.rows_different
            )?;
        }
        if let Some(w) = self.worst_error_log2 {
            let rows: Vec<String> = self
                .worst_rows
                .iter()
                .map(|r| format!("row {} key {}: {}", r.row, r.key, pow2(r.error_log2)))
                .collect();
            writeln!(
                f,
                "    worst |x - ref| / M: {} (worst rows: {})",
                pow2(w),
                rows.join(", ")
            )?;
        }
        if let Some(m) = &self.margin_summary {
            writeln!(f, "    {m}")?;
        }
        for note in &self.notes {
            writeln!(f, "    {note}")?;
        }
        Ok(())
    }
}

/// The tensors as a JSON object keyed by name.
pub(crate) fn tensor_map<S: Serializer>(
    ts: &[TensorVerdict],
    s: S,
) -> std::result::Result<S::Ok, S::Error> {
    let mut m = s.serialize_map(Some(ts.len()))?;
    for t in ts {
        m.serialize_entry(t.name, t)?;
    }
    m.end()
}

/// Bytes in binary units, 2 decimals: `512 B`, `1.50 KiB`, `2.00 GiB`.
pub fn human_bytes(b: u128) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", units[u])
    }
}

/// One row in detail: its range, candidates, bound and K-th score, its best keys by
/// the reference's score, and the replayed and expected selections.
#[derive(Debug, Clone, PartialEq)]
pub struct RowReport {
    /// `row 7 (request 0, position 12, 13 visible keys)`.
    pub label: String,
    /// SPEC 3's `ks`.
    pub ks: usize,
    /// SPEC 3's `ke`.
    pub ke: usize,
    /// Candidate keys.
    pub candidates: usize,
    /// The row's `M`, `max_j M_j` over its visible keys (SPEC 9's unit of tolerance).
    pub m: f64,
    /// The K-th score among the candidates (`None` without candidates).
    pub kth: Option<f32>,
    /// The 32 best candidates by score: (key, score).
    pub best: Vec<(usize, f32)>,
    /// The replayed selection.
    pub replayed_raw: Vec<usize>,
    /// The expected `raw` row up to its first `-1`, if the dump has one.
    pub expected_raw: Option<Vec<i32>>,
    /// The replayed `page` row up to its first `-1`.
    pub replayed_page: Vec<i32>,
    /// Every visible score, for rows of at most 64 keys.
    pub scores: Option<Vec<f32>>,
}

impl RowReport {
    /// Row `i` of `p` (numbered `number` in the caller's numbering) with its replayed
    /// outputs `out` and the dump's `expected` tensors.
    pub fn new(
        p: &Problem,
        i: usize,
        number: usize,
        out: &Output,
        expected: &Expected,
    ) -> Result<RowReport> {
        if i >= p.batch.num_rows() {
            return Err(Error::range("row", i, "a row of the problem"));
        }
        let r = p.batch.rows()[i];
        let scores = row_scores(p, i);
        let cands = row_candidates(p, i);
        let mut ranked = cands.clone();
        ranked.sort_by(|&a, &b| {
            rank_key(scores[b])
                .cmp(&rank_key(scores[a]))
                .then(a.cmp(&b))
        });
        let upto = |row: ndarray::ArrayView1<i32>| -> Vec<i32> {
            row.iter().copied().take_while(|&x| x >= 0).collect()
        };
        Ok(RowReport {
            label: row_label(p, i, number),
            ks: r.ks,
            ke: r.ke(),
            candidates: cands.len(),
            m: row_magnitude(p, i),
            kth: (!cands.is_empty()).then(|| kth_score(&scores, &cands, p.topk)),
            best: ranked.iter().take(32).map(|&j| (j, scores[j])).collect(),
            replayed_raw: parse_row(out.raw.row(i).as_slice().unwrap_or(&[])).unwrap_or_default(),
            expected_raw: expected.raw.as_ref().map(|raw| upto(raw.row(i))),
            replayed_page: upto(out.page.row(i)),
            scores: (r.n <= 64).then_some(scores),
        })
    }
}

impl fmt::Display for RowReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{}: ks {}, ke {}, {} candidates, M {:.3e} (2^-13 M = {:.3e})",
            self.label,
            self.ks,
            self.ke,
            self.candidates,
            self.m,
            self.m * super::DEFAULT_TOLERANCE_LOG2.exp2()
        )?;
        if let Some(k) = self.kth {
            writeln!(f, "  K-th score: {k:e}")?;
        }
        writeln!(f, "  best {} by score:", self.candidates.min(32))?;
        for (j, s) in &self.best {
            writeln!(f, "    key {j:>8}  {s:e}")?;
        }
        writeln!(f, "  replayed raw: {}", abbrev(&self.replayed_raw, true))?;
        if let Some(e) = &self.expected_raw {
            writeln!(f, "  expected raw: {e:?}")?;
        }
        writeln!(f, "  replayed page: {:?}", self.replayed_page)?;
        if let Some(s) = &self.scores {
            writeln!(f, "  all scores: {s:?}")?;
        }
        Ok(())
    }
}
