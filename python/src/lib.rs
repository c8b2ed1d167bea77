//! `dsa_indexer._native`: the library's CPU reference, plan, dumps and SPEC 9 judge
//! for Python. The Python package `dsa_indexer` wraps these functions; their
//! arguments arrive as one dict per layer ([`layer::Layer::from_dict`]).
//!
//! Errors: a library error naming bad input is a `ValueError` carrying the library's
//! message; a backend failure (no GPU, a driver or NVRTC error) a `RuntimeError`; a file
//! that cannot be read or written an `OSError`. Every entry point runs inside
//! [`guard`], so a panic, which would be a bug, is a `RuntimeError` and not an abort.

mod export;
mod judge;
mod layer;
mod tensor;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Instant;

use dsa_indexer::batch::Batch;
use dsa_indexer::dump::{Dump, Expected, KData, Layout, QData, RoleKind};
use dsa_indexer::indexer::{self, CpuBackend};
use dsa_indexer::problem::Problem;
use dsa_indexer::reference::Output;
use dsa_indexer::{Error, Result};
use ndarray::Array2;
use pyo3::exceptions::{PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use export::Array;
use judge::{JudgeOpts, Report};
use layer::Layer;
use tensor::{bad, Tensor};

/// A library error as a Python exception: a backend failure is the environment's
/// (`RuntimeError`), every other error names bad input (`ValueError`). An argument's
/// tensor (an [`Error::Dump`] of this package's checks) reads `q: shape [..], ...`;
/// errors about a dump file are made by [`replay`] and [`load_dump`], with its name.
pub(crate) fn to_py(e: Error) -> PyErr {
    match e {
        Error::Backend { .. } => PyRuntimeError::new_err(e.to_string()),
        Error::Dump { tensor, problem } => PyValueError::new_err(format!("{tensor}: {problem}")),
        _ => PyValueError::new_err(e.to_string()),
    }
}

/// Run `f`, turning a panic into a `RuntimeError` that says it is a bug.
fn guard<T>(f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|payload| {
        let msg = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a message".into());
        Err(PyRuntimeError::new_err(format!(
            "internal error in dsa_indexer (a bug, please report it): panic: {msg}"
        )))
    })
}

/// A byte count argument (`budget`).
fn bytes_arg(name: &str, v: i64) -> PyResult<usize> {
    usize::try_from(v).map_err(|_| {
        to_py(Error::OutOfRange {
            field: name.into(),
            value: v.to_string(),
            expected: "budget > 0 bytes",
        })
    })
}

// ==== running ====

/// Where a problem runs.
#[derive(Clone, Copy)]
enum Device {
    Cpu,
    Cuda,
}

impl Device {
    fn parse(s: &str) -> PyResult<Device> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda),
            _ => Err(to_py(Error::OutOfRange {
                field: "device".into(),
                value: format!("{s:?}"),
                expected: "\"cpu\" or \"cuda\"",
            })),
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Cuda => "cuda",
        }
    }

    /// As the CLI's report words it: `cpu (avx2, 8 threads)`.
    fn describe(&self) -> String {
        match self {
            Device::Cpu => format!(
                "cpu ({}, {} threads)",
                dsa_indexer::cpu::Isa::detect().name(),
                rayon::current_num_threads()
            ),
            Device::Cuda => "cuda".into(),
        }
    }

    /// Run `p` through the chunked driver on this device.
    fn run(&self, p: &Problem, budget: usize) -> Result<Output> {
        match self {
            Device::Cpu => Ok(indexer::run(&mut CpuBackend::new(), p, budget)?.0),
            #[cfg(feature = "cuda")]
            Device::Cuda => {
                let mut b = dsa_indexer::cuda::CudaBackend::new()?;
                Ok(indexer::run(&mut b, p, budget)?.0)
            }
            #[cfg(not(feature = "cuda"))]
            Device::Cuda => Err(Error::Backend {
                backend: "cuda",
                problem: "this build of dsa_indexer has no CUDA support (build it with \
                          MATURIN_PEP517_ARGS=\"--features cuda\" pip install ./python)"
                    .into(),
            }),
        }
    }
}

// ==== reference and plan ====

/// The outputs of the layer `args` on the CPU (the chunked driver under `budget`,
/// bitwise the reference), and the reference's visible logits when `logits`.
#[pyfunction]
#[pyo3(signature = (args, budget, logits))]
fn reference<'py>(
    py: Python<'py>,
    args: &Bound<'py, PyDict>,
    budget: i64,
    logits: bool,
) -> PyResult<Bound<'py, PyDict>> {
    guard(|| {
        let layer = Layer::from_dict(args)?;
        let budget = bytes_arg("budget", budget)?;
        let parts = layer.parts().map_err(to_py)?;
        let p = layer.problem(&parts).map_err(to_py)?;
        let (out, flat) = py
            .detach(|| -> Result<_> {
                let (out, _) = indexer::run_cpu(&p, budget)?;
                Ok((out, logits.then(|| dsa_indexer::reference::logits(&p))))
            })
            .map_err(to_py)?;
        let d = PyDict::new(py);
        let t = p.batch.num_rows();
        let published_rows: Vec<i32> = (0..t)
            .filter(|&i| p.publishes(i))
            .map(|i| i as i32)
            .collect();
        let prows = published_rows.len();
        d.set_item("ks", Array::new(ks(p.batch), &[t]))?;
        d.set_item("ke", Array::new(ke(p.batch), &[t]))?;
        d.set_item("raw", Array::from_nd(out.raw))?;
        d.set_item("page", Array::from_nd(out.page))?;
        match out.published {
            Some(pb) => {
                d.set_item("published", Array::from_nd(pb.blocks))?;
                d.set_item("published_rows", Array::new(published_rows, &[prows]))?;
            }
            None => {
                d.set_item("published", py.None())?;
                d.set_item("published_rows", py.None())?;
            }
        }
        match flat {
            Some(l) => {
                let n = l.len();
                d.set_item("logits", Array::new(l, &[n]))?
            }
            None => d.set_item("logits", py.None())?,
        }
        Ok(d)
    })
}

fn ks(b: &Batch) -> Vec<i32> {
    b.rows().iter().map(|r| r.ks as i32).collect()
}

fn ke(b: &Batch) -> Vec<i32> {
    b.rows().iter().map(|r| r.ke() as i32).collect()
}

/// The CPU backend's plan of the layer `args` under `budget`: its tiles and its
/// peak transient term by term, as a dict.
#[pyfunction]
#[pyo3(signature = (args, budget))]
fn plan<'py>(
    py: Python<'py>,
    args: &Bound<'py, PyDict>,
    budget: i64,
) -> PyResult<Bound<'py, PyDict>> {
    guard(|| {
        let layer = Layer::from_dict(args)?;
        let budget = bytes_arg("budget", budget)?;
        let parts = layer.parts().map_err(to_py)?;
        let p = layer.problem(&parts).map_err(to_py)?;
        let plan = indexer::plan_for(&CpuBackend::new(), &p, budget).map_err(to_py)?;
        let tiles = PyList::empty(py);
        for t in &plan.tiles {
            let d = PyDict::new(py);
            d.set_item("rows", (t.rows.start, t.rows.end))?;
            d.set_item("published", (t.published.start, t.published.end))?;
            d.set_item("logits_bytes", t.logits_bytes)?;
            d.set_item("block_score_bytes", t.block_score_bytes)?;
            d.set_item("oversized", t.oversized)?;
            tiles.append(d)?;
        }
        let pk = &plan.peak;
        let peak = PyDict::new(py);
        peak.set_item("logits_tile", pk.logits_tile)?;
        peak.set_item("block_scores", pk.block_scores)?;
        peak.set_item("candidate_ids", pk.candidate_ids)?;
        peak.set_item("topk_scratch", pk.topk_scratch)?;
        peak.set_item("index_assembly", pk.index_assembly)?;
        peak.set_item("operands", pk.operands)?;
        peak.set_item("total", pk.total())?;
        let d = PyDict::new(py);
        d.set_item("backend", "cpu")?;
        d.set_item("budget", budget)?;
        d.set_item("tiles", tiles)?;
        d.set_item("peak", peak)?;
        d.set_item("workers", plan.workers)?;
        d.set_item("max_tile_rows", plan.max_tile_rows)?;
        d.set_item("published_rows", plan.published_rows)?;
        d.set_item("oversized_row", plan.has_oversized_row())?;
        d.set_item("unbounded_bytes", plan.unbounded_bytes)?;
        Ok(d)
    })
}

// ==== outputs to judge ====

const OUTPUT_KEYS: [&str; 8] = [
    "raw",
    "page",
    "published",
    "published_rows",
    "ks",
    "ke",
    "logits",
    "engine_logits",
];

/// An `int32` (or `int64`) tensor as `[rows, cols]`.
fn i32_2d(t: &Tensor) -> Result<Array2<i32>> {
    if t.shape.len() != 2 {
        return Err(t.error("int32 [rows, columns]"));
    }
    let v = t.i32s()?.as_slice().to_vec();
    Array2::from_shape_vec((t.shape[0], t.shape[1]), v).map_err(|e| bad(t.name, e.to_string()))
}

/// An `int32` (or `int64`) tensor of one dimension.
fn i32_1d(t: &Tensor) -> Result<Vec<i32>> {
    if t.shape.len() != 1 {
        return Err(t.error("int32 [rows]"));
    }
    Ok(t.i32s()?.as_slice().to_vec())
}

/// The names `check`'s arguments give the outputs, in [`OUTPUT_KEYS`]'s order.
const ENGINE_NAMES: [&str; 8] = [
    "engine_raw",
    "engine_page",
    "engine_published",
    "engine_published_rows",
    "engine_ks",
    "engine_ke",
    "engine_logits",
    "engine_logits",
];

/// The names `save_dump`'s arguments (and the dump schema) give them.
const DUMP_NAMES: [&str; 8] = [
    "expected_raw",
    "expected_page",
    "expected_published",
    "expected_published_rows",
    "expected_ks",
    "expected_ke",
    "expected_logits",
    "engine_logits",
];

/// Outputs to judge (or to write into a dump), keyed by the schema's names without
/// the `expected_` prefix: `raw`, `page`, `published`, `published_rows`, `ks`, `ke`,
/// `logits` (`[sum n]`, the reference's form) and `engine_logits` (`[T, L]`); errors
/// name them as `names` does.
fn outputs(
    d: &Bound<'_, PyDict>,
    names: &[&'static str; 8],
) -> PyResult<(Expected, Option<Array2<f32>>)> {
    let mut e = Expected::default();
    let mut engine = None;
    for (k, v) in d.iter() {
        if v.is_none() {
            continue;
        }
        let k: String = k.extract()?;
        let Some(i) = OUTPUT_KEYS.iter().position(|&n| n == k) else {
            return Err(to_py(bad(&k, "not an output the judge reads")));
        };
        let t = Tensor::import(names[i], &v)?;
        let r: Result<()> = (|| {
            match OUTPUT_KEYS[i] {
                "raw" => e.raw = Some(i32_2d(&t)?),
                "page" => e.page = Some(i32_2d(&t)?),
                "published" => e.published = Some(i32_2d(&t)?),
                "published_rows" => e.published_rows = Some(i32_1d(&t)?),
                "ks" => e.ks = Some(i32_1d(&t)?),
                "ke" => e.ke = Some(i32_1d(&t)?),
                "logits" => {
                    if t.shape.len() != 1 {
                        return Err(t.error("float32 [sum n]"));
                    }
                    e.logits = Some(t.floats()?.as_slice().to_vec());
                }
                _ => {
                    if t.shape.len() != 2 {
                        return Err(t.error("float32 [T, L]"));
                    }
                    let v = t.floats()?.as_slice().to_vec();
                    engine = Some(
                        Array2::from_shape_vec((t.shape[0], t.shape[1]), v)
                            .map_err(|err| bad(t.name, err.to_string()))?,
                    );
                }
            }
            Ok(())
        })();
        r.map_err(to_py)?;
    }
    Ok((e, engine))
}

/// A judge's error on an engine's outputs named as `check`'s arguments name them
/// (`engine_raw` where a dump has `expected_raw`).
fn engine_names(e: Error) -> Error {
    match e {
        Error::Dump { tensor, problem } => Error::Dump {
            tensor: match tensor.strip_prefix("expected_") {
                Some(t) => format!("engine_{t}"),
                None => tensor,
            },
            problem,
        },
        e => e,
    }
}

/// Judge an engine's `engine` outputs of the layer `args` against the reference's,
/// computed on the CPU under `budget`.
#[pyfunction]
#[pyo3(signature = (args, engine, budget, max_notes, full_ids))]
fn check(
    py: Python<'_>,
    args: &Bound<'_, PyDict>,
    engine: &Bound<'_, PyDict>,
    budget: i64,
    max_notes: usize,
    full_ids: bool,
) -> PyResult<Report> {
    guard(|| {
        let t0 = Instant::now();
        let layer = Layer::from_dict(args)?;
        let (expected, engine_logits) = outputs(engine, &ENGINE_NAMES)?;
        let budget = bytes_arg("budget", budget)?;
        let parts = layer.parts().map_err(to_py)?;
        let p = layer.problem(&parts).map_err(to_py)?;
        dsa_indexer::verdict::check_shapes(&p, &expected, engine_logits.as_ref())
            .map_err(|e| to_py(engine_names(e)))?;
        let parse = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let out = py.detach(|| Device::Cpu.run(&p, budget)).map_err(to_py)?;
        let opts = JudgeOpts {
            file: "check".into(),
            row_numbers: None,
            partial: false,
            max_notes,
            full_ids,
            device: ("cpu", Device::Cpu.describe()),
            budget,
            parse,
            run: t1.elapsed().as_secs_f64(),
        };
        let r = py
            .detach(|| judge::judge(&p, &out, &expected, engine_logits.as_ref(), &opts))
            .map_err(|e| to_py(engine_names(e)))?;
        Ok(Report::new(r))
    })
}

// ==== dumps ====

/// Write the layer `args` with the outputs `expected` as a SPEC 9 dump (the library's
/// writer: the files `dsa-indexer replay` reads).
#[pyfunction]
#[pyo3(signature = (path, args, expected, description))]
fn save_dump(
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
    /// `role`, `block_size`, `num_blocks`, `page_cols`, `tail`, `description`.
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
        d.set_item("description", m.description.clone())?;
        Ok(d)
    }

    /// The tensors by the schema's names, as the reader holds them: E4M3 codes and
    /// packed fp4 as `uint8`, scales as `uint8` bytes or `float32`, weights `float32`,
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
fn load_dump(path: std::path::PathBuf) -> PyResult<DumpFile> {
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
) -> Result<Vec<usize>> {
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
    Ok((0..t)
        .filter(|&i| rows.is_none_or(|(a, b)| (a..b).contains(&i)))
        .filter(|&i| request.is_none_or(|r| batch.rows()[i].request == r))
        .collect())
}

/// The CLI's default replay budget: a 32nd of the dump's logits, between 16 MiB and
/// 256 MiB (the outputs do not depend on it).
fn default_budget(batch: &Batch) -> usize {
    let logits: usize = batch
        .rows()
        .iter()
        .map(|r| r.n.div_ceil(4) * 16)
        .fold(0, usize::saturating_add);
    (logits / 32).clamp(16 << 20, 256 << 20)
}

/// Replay a dump (a path, or a [`DumpFile`]) on `device` and judge the outputs it
/// carries: what `dsa-indexer replay` reports.
#[pyfunction]
#[pyo3(signature = (source, device, rows, request, budget, max_notes, full_ids))]
#[allow(clippy::too_many_arguments)]
fn replay(
    py: Python<'_>,
    source: &Bound<'_, PyAny>,
    device: &str,
    rows: Option<(usize, usize)>,
    request: Option<usize>,
    budget: Option<i64>,
    max_notes: usize,
    full_ids: bool,
) -> PyResult<Report> {
    guard(|| {
        let t0 = Instant::now();
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
            None => default_budget(&batch),
        };
        let t1 = Instant::now();
        let out = py.detach(|| device.run(&p, budget)).map_err(with_name)?;
        let opts = JudgeOpts {
            file: name.clone(),
            row_numbers: Some(&sel),
            partial,
            max_notes,
            full_ids,
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

// ==== the module ====

/// Panics inside a rayon worker with the GIL released, inside the boundary guard:
/// the tests' proof that a panic reaches Python as an exception, not an abort.
#[pyfunction]
fn _panic_for_tests(py: Python<'_>) -> PyResult<()> {
    use rayon::prelude::*;
    guard(|| {
        py.detach(|| {
            (0..4).into_par_iter().for_each(|i| {
                if i == 3 {
                    panic!("raised on purpose by _panic_for_tests");
                }
            })
        });
        Ok(())
    })
}

/// The addresses of the buffers the library reads for the layer `args` (a test hook:
/// inputs are read in place, not copied).
#[pyfunction]
fn _input_pointers(args: &Bound<'_, PyDict>) -> PyResult<Vec<(&'static str, usize)>> {
    use dsa_indexer::problem::{Keys, Queries};
    guard(|| {
        let layer = Layer::from_dict(args)?;
        let i = layer.inputs().map_err(to_py)?;
        let mut v = Vec::new();
        match i.q {
            Queries::E4m3(q) => v.push(("q", q.as_ptr() as usize)),
            Queries::E2m1 { packed, scale } => {
                v.push(("q", packed.as_ptr() as usize));
                v.push(("q_scale", scale.as_ptr() as usize));
            }
        }
        match i.k {
            Keys::E4m3 { codes, scale } => {
                v.push(("k", codes.as_ptr() as usize));
                v.push(("k_scale", scale.as_ptr() as usize));
            }
            Keys::E2m1 { packed, scale } => {
                v.push(("k", packed.as_ptr() as usize));
                v.push(("k_scale", scale.as_ptr() as usize));
            }
        }
        v.push(("weights", i.weights.as_ptr() as usize));
        if let Some(s) = i.k_slots {
            v.push(("k_slots", s.as_ptr() as usize));
        }
        Ok(v)
    })
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Array>()?;
    m.add_class::<Report>()?;
    m.add_class::<DumpFile>()?;
    m.add_function(wrap_pyfunction!(reference, m)?)?;
    m.add_function(wrap_pyfunction!(plan, m)?)?;
    m.add_function(wrap_pyfunction!(check, m)?)?;
    m.add_function(wrap_pyfunction!(save_dump, m)?)?;
    m.add_function(wrap_pyfunction!(load_dump, m)?)?;
    m.add_function(wrap_pyfunction!(replay, m)?)?;
    m.add_function(wrap_pyfunction!(_panic_for_tests, m)?)?;
    m.add_function(wrap_pyfunction!(_input_pointers, m)?)?;
    m.add("CUDA", cfg!(feature = "cuda"))?;
    Ok(())
}
