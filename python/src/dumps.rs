//! Dumps (SPEC 9) from Python: written and read by the library's writer and reader,
//! and replayed as `dsa-indexer replay` replays them.

use std::time::Instant;

use dsa_indexer::batch::Batch;
use dsa_indexer::dump::{Dump, KData, Layout, QData, RoleKind};
use dsa_indexer::Error;
use pyo3::exceptions::{PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::export::Array;
use crate::judge::{self, JudgeOpts, Report};
use crate::layer::Layer;
use crate::outputs::{outputs, DUMP_NAMES};
use crate::{bytes_arg, guard, to_py, Device};

/// Write the layer `args` with the outputs `expected` as a SPEC 9 dump (the library's
/// writer: the files `dsa-indexer replay` reads).
#[pyfunction]
#[pyo3(signature = (path, args, expected, description))]
pub(crate) fn save_dump(
    path: std::path::PathBuf,
    args: &Bound<'_, PyDict>,
    expected: &Bound<'_, PyDict>,
    description: String,
) -> PyResult<()> {
    guard(|| {
        let layer = Layer::from_dict(args)?;
        let (e, engine_logits) = outputs(expected, &DUMP_NAMES)?;
        let parts = layer.parts().map_err(to_py)?;
        // The same checks `replay` makes: a dump written here replays.
        let p = layer.problem(&parts).map_err(to_py)?;
        dsa_indexer::verdict::check_shapes(&p, &e, engine_logits.as_ref()).map_err(to_py)?;
        let dump = layer
            .to_dump(e, engine_logits, description)
            .map_err(to_py)?;
        let bytes = dump.to_bytes().map_err(to_py)?;
        std::fs::write(&path, bytes)
            .map_err(|e| PyOSError::new_err(format!("{}: {e}", path.display())))
    })
}

/// A dump read by the library's reader.
#[pyclass(module = "dsa_indexer._native", frozen)]
pub struct DumpFile {
    path: String,
    dump: Dump,
}

fn role_name(r: RoleKind) -> &'static str {
    match r {
        RoleKind::Plain => "plain",
        RoleKind::Source => "source",
        RoleKind::Consumer => "consumer",
    }
}

fn usizes_i32(v: &[usize]) -> Vec<i32> {
    v.iter().map(|&x| x as i32).collect()
}

#[pymethods]
impl DumpFile {
    /// The file it was read from.
    #[getter]
    fn path(&self) -> &str {
        &self.path
    }

    /// The metadata, typed: `heads`, `dim`, `topk`, `ratio`, `q_format`, `k_format`,
    /// `role`, `block_size`, `num_blocks`, `page_cols`, `tail`, `page_size` (paged keys,
    /// else `None`), `next_n`, `description`.
    fn meta<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let m = &self.dump.meta;
        let d = PyDict::new(py);
        d.set_item("heads", m.heads)?;
        d.set_item("dim", m.dim)?;
        d.set_item("topk", m.topk)?;
        d.set_item("ratio", m.ratio)?;
        d.set_item("q_format", m.q_format.to_string())?;
        d.set_item("k_format", m.k_format.to_string())?;
        d.set_item("role", role_name(m.role))?;
        d.set_item("block_size", m.block_size)?;
        d.set_item("num_blocks", m.num_blocks)?;
        d.set_item("page_cols", m.page_cols)?;
        d.set_item("tail", m.tail)?;
        let page_size = match &self.dump.k {
            KData::Paged { page_size, .. } => Some(*page_size),
            _ => None,
        };
        d.set_item("page_size", page_size)?;
        d.set_item("next_n", m.next_n)?;
        d.set_item("description", m.description.clone())?;
        Ok(d)
    }

    /// The tensors by the schema's names, as the reader holds them: E4M3 codes, packed
    /// fp4 and the page pool as `uint8`, page tables `int32`, scales as `uint8` bytes or `float32`, weights `float32`,
    /// indices `int32`.
    fn tensors(&self) -> Vec<(&'static str, Array)> {
        let d = &self.dump;
        let mut t: Vec<(&'static str, Array)> = Vec::new();
        let n = d.seq_lens.len();
        t.push(("seq_lens", Array::new(usizes_i32(&d.seq_lens), &[n])));
        match &d.layout {
            Layout::Contiguous(q0) => {
                t.push(("query_starts", Array::new(usizes_i32(q0), &[q0.len()])))
            }
            Layout::Explicit {
                requests,
                positions,
            } => {
                t.push((
                    "row_requests",
                    Array::new(usizes_i32(requests), &[requests.len()]),
                ));
                t.push((
                    "row_positions",
                    Array::new(usizes_i32(positions), &[positions.len()]),
                ));
            }
        }
        match &d.q {
            QData::E4m3(q) => t.push(("q", Array::from_nd(q.clone()))),
            QData::E2m1 { packed, scale } => {
                t.push(("q", Array::from_nd(packed.clone())));
                t.push(("q_scale", Array::from_nd(scale.clone())));
            }
        }
        match &d.k {
            KData::E4m3 { codes, scale } => {
                t.push(("k", Array::from_nd(codes.clone())));
                t.push(("k_scale", Array::from_nd(scale.clone())));
            }
            KData::E2m1 { packed, scale } => {
                t.push(("k", Array::from_nd(packed.clone())));
                t.push(("k_scale", Array::from_nd(scale.clone())));
            }
            KData::Paged {
                kv_cache,
                page_table,
                ..
            } => {
                t.push(("kv_cache", Array::from_nd(kv_cache.clone())));
                t.push(("page_table", Array::from_nd(page_table.clone())));
            }
        }
        t.push(("weights", Array::from_nd(d.weights.clone())));
        if let Some(s) = &d.k_slots {
            t.push(("k_slots", Array::from_nd(s.clone())));
        }
        if let Some(c) = &d.candidates {
            t.push(("candidates", Array::from_nd(c.clone())));
        }
        let e = &d.expected;
        for (name, a) in [
            ("expected_raw", &e.raw),
            ("expected_page", &e.page),
            ("expected_published", &e.published),
        ] {
            if let Some(a) = a {
                t.push((name, Array::from_nd(a.clone())));
            }
        }
        for (name, v) in [
            ("expected_published_rows", &e.published_rows),
            ("expected_ks", &e.ks),
            ("expected_ke", &e.ke),
        ] {
            if let Some(v) = v {
                t.push((name, Array::new(v.clone(), &[v.len()])));
            }
        }
        if let Some(l) = &e.logits {
            t.push(("expected_logits", Array::new(l.clone(), &[l.len()])));
        }
        if let Some(m) = &d.engine_logits {
            t.push(("engine_logits", Array::from_nd(m.clone())));
        }
        t
    }
}

/// Read a dump with the library's reader.
#[pyfunction]
pub(crate) fn load_dump(path: std::path::PathBuf) -> PyResult<DumpFile> {
    guard(|| {
        let name = path.display().to_string();
        let bytes = std::fs::read(&path).map_err(|e| PyOSError::new_err(format!("{name}: {e}")))?;
        let dump =
            Dump::from_bytes(&bytes).map_err(|e| PyValueError::new_err(format!("{name}: {e}")))?;
        Ok(DumpFile { path: name, dump })
    })
}

/// The rows of a replay: `rows = (a, b)` and `request = r` as the CLI's `--rows A..B`
/// and `--request R`, in the dump's numbering.
fn select_rows(
    batch: &Batch,
    rows: Option<(usize, usize)>,
    request: Option<usize>,
) -> dsa_indexer::Result<Vec<usize>> {
    let t = batch.num_rows();
    if let Some((a, b)) = rows {
        if a > b || b > t {
            return Err(Error::OutOfRange {
                field: "rows".into(),
                value: format!("({a}, {b})"),
                expected: "a range (a, b) inside the dump's rows",
            });
        }
    }
    if let Some(r) = request {
        if r >= batch.requests().len() {
            return Err(Error::OutOfRange {
                field: "request".into(),
                value: r.to_string(),
                expected: "a request of the dump",
            });
        }
    }
    Ok(dsa_indexer::dump::kept_rows(batch, rows, request))
}

/// Replay a dump (a path, or a [`DumpFile`]) on `device` and judge the outputs it
/// carries: what `dsa-indexer replay` reports.
#[pyfunction]
#[pyo3(signature = (source, device, rows, request, budget, max_notes, full_ids, tolerance=None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn replay(
    py: Python<'_>,
    source: &Bound<'_, PyAny>,
    device: &str,
    rows: Option<(usize, usize)>,
    request: Option<usize>,
    budget: Option<i64>,
    max_notes: usize,
    full_ids: bool,
    tolerance: Option<&Bound<'_, PyAny>>,
) -> PyResult<Report> {
    guard(|| {
        let t0 = Instant::now();
        let tolerance = judge::tolerance_arg(tolerance).map_err(to_py)?;
        let device = Device::parse(device)?;
        let loaded;
        let df: &DumpFile = match source.cast::<DumpFile>() {
            Ok(d) => {
                loaded = d.clone().unbind();
                loaded.get()
            }
            Err(_) => {
                let path: std::path::PathBuf = source.extract()?;
                loaded = Py::new(py, load_dump(path)?)?;
                loaded.get()
            }
        };
        let name = df.path.clone();
        let with_name = |e: Error| match e {
            Error::Backend { .. } => PyRuntimeError::new_err(format!("{name}: {e}")),
            _ => PyValueError::new_err(format!("{name}: {e}")),
        };
        let full_batch = df.dump.batch().map_err(with_name)?;
        let sel = select_rows(&full_batch, rows, request).map_err(to_py)?;
        let partial = sel.len() != full_batch.num_rows();
        let cut;
        let (dump, batch) = if partial {
            cut = df.dump.select_rows(&full_batch, &sel).map_err(with_name)?;
            let b = cut.batch().map_err(with_name)?;
            (&cut, b)
        } else {
            (&df.dump, full_batch)
        };
        let published = dump.published_input(&batch);
        let p = dump
            .problem(&batch, published.as_ref())
            .map_err(with_name)?;
        let e = &dump.expected;
        dsa_indexer::verdict::check_shapes(&p, e, dump.engine_logits.as_ref())
            .map_err(with_name)?;
        let parse = t0.elapsed().as_secs_f64();
        let budget = match budget {
            Some(b) => bytes_arg("budget", b)?,
            None => dsa_indexer::dump::replay_budget(&batch),
        };
        let t1 = Instant::now();
        let out = py.detach(|| device.run(&p, budget)).map_err(with_name)?;
        let opts = JudgeOpts {
            file: name.clone(),
            row_numbers: Some(&sel),
            partial,
            max_notes,
            full_ids,
            tolerance,
            device: (device.name(), device.describe()),
            budget,
            parse,
            run: t1.elapsed().as_secs_f64(),
        };
        let r = py
            .detach(|| judge::judge(&p, &out, e, dump.engine_logits.as_ref(), &opts))
            .map_err(with_name)?;
        Ok(Report::new(r))
    })
}
