//! SPEC 9's judge, called in one place ([`judge`]), and its report as a Python object.
//!
//! `replay` (a dump) and `check` (an engine's outputs given directly) both end here, so
//! a change of the library's judge (its verdicts, options, margins) is adapted once.

use std::time::Instant;

use dsa_indexer::dump::Expected;
use dsa_indexer::problem::Problem;
use dsa_indexer::reference::Output;
use dsa_indexer::verdict::Tolerance;
use dsa_indexer::verdict::{self, Layer, ReplayReport, Seconds};
use ndarray::Array2;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString};
use pyo3::IntoPyObjectExt;

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
    /// The tolerance of the selections (SPEC 9).
    pub tolerance: Tolerance,
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
        tolerance: o.tolerance,
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

/// `tolerance=` as a [`Tolerance`]: `None` (auto), `0` (exact ties only), a positive
/// number `<= 1` (`2**-13`: its `log2`), or the CLI's words (`"auto"`, `"0"`, `"2^-13"`).
/// Anything else is the library's error naming `tolerance`.
pub fn tolerance_arg(t: Option<&Bound<'_, PyAny>>) -> dsa_indexer::Result<Tolerance> {
    let Some(t) = t else {
        return Ok(Tolerance::Auto);
    };
    if let Ok(s) = t.cast::<PyString>() {
        return s.to_string().parse();
    }
    // A bool is an int to Python, and means nothing here.
    let number = if t.is_instance_of::<pyo3::types::PyBool>() {
        None
    } else {
        t.extract::<f64>().ok()
    };
    match number {
        Some(0.0) => Ok(Tolerance::Ties),
        Some(x) if x > 0.0 && x <= 1.0 => Tolerance::pow2(x.log2()),
        Some(x) => format!("{x}").parse(),
        None => {
            let shown = t.repr().map(|r| r.to_string()).unwrap_or_default();
            // Not a word the parser knows: its error names `tolerance` and the value.
            format!("<{shown}>").parse()
        }
    }
}

/// A JSON value as plain Python values (dicts, lists, str, int, float, bool, None).
fn to_python<'py>(py: Python<'py>, v: &serde_json::Value) -> PyResult<Bound<'py, PyAny>> {
    use serde_json::Value;
    Ok(match v {
        Value::Null => py.None().into_bound(py),
        Value::Bool(b) => b.into_bound_py_any(py)?,
        Value::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => i.into_bound_py_any(py)?,
            (None, Some(u)) => u.into_bound_py_any(py)?,
            _ => n.as_f64().unwrap_or(f64::NAN).into_bound_py_any(py)?,
        },
        Value::String(s) => s.into_bound_py_any(py)?,
        Value::Array(a) => {
            let l = PyList::empty(py);
            for x in a {
                l.append(to_python(py, x)?)?;
            }
            l.into_any()
        }
        Value::Object(o) => {
            let d = PyDict::new(py);
            for (k, x) in o {
                d.set_item(k, to_python(py, x)?)?;
            }
            d.into_any()
        }
    })
}

/// `x` through its JSON form, as the CLI's `--json` writes it.
fn serialized<'py, T: serde::Serialize>(py: Python<'py>, x: &T) -> PyResult<Bound<'py, PyAny>> {
    let v = serde_json::to_value(x)
        .map_err(|e| pyo3::exceptions::PyRuntimeError::new_err(e.to_string()))?;
    to_python(py, &v)
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
    /// The verdict's words: `identical`, `equal up to ties`, `equal within tolerance`,
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

    /// Each judged part by name, in the judge's order, as `--json` writes it: a dict
    /// of `status`, `compared_rows`, `rows_ties`, `rows_tolerant`, `rows_different`,
    /// `first_different_row`, `notes`, and where the part has them `tolerance`,
    /// `margins`, `margin_summary`, `worst_error_log2`, `worst_rows`.
    fn tensors<'py>(&self, py: Python<'py>) -> PyResult<Vec<(&'static str, Bound<'py, PyAny>)>> {
        self.r
            .verdict
            .tensors
            .iter()
            .map(|t| Ok((t.name, serialized(py, t)?)))
            .collect()
    }

    /// The tolerance the selections were judged with: a dict of `source` (`measured`,
    /// `default`, `given`), `rule`, `log2` (`None`: exact ties only) and `why`.
    fn tolerance<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        serialized(py, &self.r.verdict.tolerance)
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
