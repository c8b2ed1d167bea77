//! SPEC 9's judge, called in one place ([`judge`]), and its report as a Python object.
//!
//! `replay` (a dump) and `check` (an engine's outputs given directly) both end here, so
//! a change of the library's judge (its verdicts, options, margins) is adapted once.

use std::time::Instant;

use dsa_indexer::dump::Expected;
use dsa_indexer::problem::Problem;
use dsa_indexer::reference::Output;
use dsa_indexer::verdict::{self, Layer, ReplayReport, Seconds};
use ndarray::Array2;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// What a judgement is asked for besides the tensors.
pub struct JudgeOpts<'a> {
    /// The name the report gives the outputs (a file name, or `check`).
    pub file: String,
    /// For a replay of some rows: their numbers in the whole dump.
    pub row_numbers: Option<&'a [usize]>,
    /// Whether only some of the dump's rows are judged.
    pub partial: bool,
    /// Notes kept per tensor.
    pub max_notes: usize,
    /// Index sets in full.
    pub full_ids: bool,
    /// Where the replay ran (`cpu`, `cuda`) and in words.
    pub device: (&'static str, String),
    /// The run's logits budget, bytes.
    pub budget: usize,
    /// Seconds spent reading and running before the judge.
    pub parse: f64,
    /// Seconds of the run.
    pub run: f64,
}

/// Judge `expected` (and `engine_logits`) against `replayed`, the outputs of `p` on a
/// backend bitwise equal to the reference: the report the CLI's `replay` prints.
pub fn judge(
    p: &Problem,
    replayed: &Output,
    expected: &Expected,
    engine_logits: Option<&Array2<f32>>,
    o: &JudgeOpts,
) -> dsa_indexer::Result<ReplayReport> {
    let t = Instant::now();
    let opts = verdict::Options {
        row_numbers: o.row_numbers,
        max_notes: o.max_notes,
        full_ids: o.full_ids,
    };
    let v = verdict::judge(p, replayed, expected, engine_logits, &opts)?;
    Ok(ReplayReport {
        file: o.file.clone(),
        partial: o.partial,
        layer: Layer::of(p),
        device: o.device.0.into(),
        device_detail: o.device.1.clone(),
        budget: o.budget,
        seconds: Seconds {
            parse: o.parse,
            run: o.run,
            diff: t.elapsed().as_secs_f64(),
        },
        verdict: v,
    })
}

/// A judgement: the verdict, each tensor's status, the text and the JSON of the CLI.
#[pyclass(module = "dsa_indexer._native", frozen)]
pub struct Report {
    r: ReplayReport,
}

impl Report {
    /// Wrap a report.
    pub fn new(r: ReplayReport) -> Report {
        Report { r }
    }
}

#[pymethods]
impl Report {
    /// The verdict's words: `identical`, `equal up to ties and tolerance`,
    /// `different`, or `no expected outputs`.
    #[getter]
    fn verdict(&self) -> &'static str {
        self.r.verdict.status.as_str()
    }

    /// The CLI's exit code for this verdict: 1 when different, else 0.
    #[getter]
    fn exit_code(&self) -> i32 {
        self.r.exit_code()
    }

    /// Each judged tensor by name, in the judge's order: a dict of its status, rows
    /// compared, rows within ties and tolerance, rows different, the first different
    /// row and the notes.
    fn tensors<'py>(&self, py: Python<'py>) -> PyResult<Vec<(&'static str, Bound<'py, PyDict>)>> {
        self.r
            .verdict
            .tensors
            .iter()
            .map(|t| {
                let d = PyDict::new(py);
                d.set_item("status", t.status.as_str())?;
                d.set_item("compared_rows", t.compared_rows)?;
                d.set_item("rows_tolerant", t.rows_tolerant)?;
                d.set_item("rows_different", t.rows_different)?;
                d.set_item("first_different_row", t.first_different_row)?;
                d.set_item("notes", t.notes.clone())?;
                Ok((t.name, d))
            })
            .collect()
    }

    /// The report as `dsa-indexer replay --json` prints it.
    fn json(&self) -> String {
        // Through a `Value`, whose object keys are ordered, as the CLI does.
        let j = serde_json::to_value(&self.r).unwrap_or_default();
        serde_json::to_string_pretty(&j).unwrap_or_default()
    }

    /// The report as `dsa-indexer replay` prints it.
    fn text(&self) -> String {
        self.r.to_string()
    }
}
