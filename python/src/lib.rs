//! `dsa_indexer._native`: the library's CPU reference, plan, dumps and SPEC 9 judge
//! for Python. The Python package `dsa_indexer` wraps these functions; their
//! arguments arrive as one dict per layer (`layer::Layer::from_dict`).
//!
//! Errors: a library error naming bad input is a `ValueError` carrying the library's
//! message; a backend failure (no GPU, a driver or NVRTC error) a `RuntimeError`; a file
//! that cannot be read or written an `OSError`. Every entry point runs inside
//! `guard`, so a panic, which would be a bug, is a `RuntimeError` and not an abort.

#[cfg(feature = "cuda")]
mod cuda;
mod dumps;
mod export;
mod judge;
mod layer;
mod outputs;
mod tensor;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Instant;

use dsa_indexer::batch::Batch;
use dsa_indexer::indexer::{self, CpuBackend};
use dsa_indexer::problem::Problem;
use dsa_indexer::reference::Output;
use dsa_indexer::{Error, Result};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use export::Array;
use judge::{JudgeOpts, Report};
use layer::Layer;
use outputs::{engine_names, outputs, ENGINE_NAMES};

/// A library error as a Python exception: a backend failure is the environment's
/// (`RuntimeError`), every other error names bad input (`ValueError`). An argument's
/// tensor (an [`Error::Dump`] of this package's checks) reads `q: shape [..], ...`;
/// errors about a dump file are made by `dumps::replay` and `dumps::load_dump`, with
/// its name.
pub(crate) fn to_py(e: Error) -> PyErr {
    match e {
        Error::Backend { .. } => PyRuntimeError::new_err(e.to_string()),
        Error::Dump { tensor, problem } => PyValueError::new_err(format!("{tensor}: {problem}")),
        _ => PyValueError::new_err(e.to_string()),
    }
}

/// Run `f`, turning a panic into a `RuntimeError` that says it is a bug.
pub(crate) fn guard<T>(f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
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
pub(crate) fn bytes_arg(name: &str, v: i64) -> PyResult<usize> {
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
pub(crate) enum Device {
    Cpu,
    Cuda,
}

impl Device {
    pub(crate) fn parse(s: &str) -> PyResult<Device> {
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

    pub(crate) fn name(&self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Cuda => "cuda",
        }
    }

    /// As the CLI's report words it: `cpu (avx2, 8 threads)`.
    pub(crate) fn describe(&self) -> String {
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
    pub(crate) fn run(&self, p: &Problem, budget: usize) -> Result<Output> {
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

// ==== the verdict ====

/// Judge an engine's `engine` outputs of the layer `args` against the reference's,
/// computed on the CPU under `budget`.
#[pyfunction]
#[pyo3(signature = (args, engine, budget, max_notes, full_ids, tolerance=None))]
fn check(
    py: Python<'_>,
    args: &Bound<'_, PyDict>,
    engine: &Bound<'_, PyDict>,
    budget: i64,
    max_notes: usize,
    full_ids: bool,
    tolerance: Option<&Bound<'_, PyAny>>,
) -> PyResult<Report> {
    guard(|| {
        let t0 = Instant::now();
        let tolerance = judge::tolerance_arg(tolerance).map_err(to_py)?;
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
            tolerance,
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

// ==== the CUDA entries' outputs ====

/// A list of integers argument (`seq_lens`, ...) as counts, a negative entry an error
/// naming it.
fn counts_arg(name: &str, v: Option<Vec<i64>>) -> PyResult<Option<Vec<usize>>> {
    v.map(|v| {
        v.into_iter()
            .enumerate()
            .map(|(i, x)| {
                usize::try_from(x).map_err(|_| {
                    to_py(Error::OutOfRange {
                        field: format!("{name}[{i}]"),
                        value: x.to_string(),
                        expected: "a value >= 0",
                    })
                })
            })
            .collect()
    })
    .transpose()
}

/// The outputs' shapes of a layer-forward from its index arguments alone (host
/// lists): `(T, page_cols, published_rows, ks, ke)`, so that the CUDA entry's outputs
/// can be allocated before it runs (and traced by `torch.compile`).
#[pyfunction]
#[pyo3(signature = (seq_lens, query_starts, row_requests, row_positions, ratio, role, tail, topk, page_cols))]
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
fn index_shapes(
    seq_lens: Vec<i64>,
    query_starts: Option<Vec<i64>>,
    row_requests: Option<Vec<i64>>,
    row_positions: Option<Vec<i64>>,
    ratio: usize,
    role: &str,
    tail: Option<usize>,
    topk: usize,
    page_cols: Option<usize>,
) -> PyResult<(usize, usize, Vec<i32>, Vec<i32>, Vec<i32>)> {
    guard(|| {
        let seq = counts_arg("seq_lens", Some(seq_lens))?.unwrap_or_default();
        let batch = match (
            counts_arg("query_starts", query_starts)?,
            counts_arg("row_requests", row_requests)?,
            counts_arg("row_positions", row_positions)?,
        ) {
            (Some(q0), None, None) => Batch::contiguous(&seq, &q0, ratio),
            (None, Some(rr), Some(rp)) => Batch::explicit(&seq, &rr, &rp, ratio),
            _ => Err(Error::Dump {
                tensor: "query_starts".into(),
                problem: "expected either query_starts, or both row_requests and row_positions"
                    .into(),
            }),
        }
        .map_err(to_py)?;
        let t = batch.num_rows();
        let published: Vec<i32> = match role {
            "source" => (0..t)
                .filter(|&i| {
                    dsa_indexer::batch::publishes(&batch.rows()[i], batch.requests(), tail)
                })
                .map(|i| i as i32)
                .collect(),
            _ => Vec::new(),
        };
        let cols = page_cols.unwrap_or(topk.div_ceil(64) * 64);
        Ok((t, cols, published, ks(&batch), ke(&batch)))
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
            Keys::Paged(pk) => {
                v.push(("kv_cache", pk.kv_cache.as_ptr() as usize));
                v.push(("page_table", pk.page_table.as_ptr() as usize));
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
    m.add_class::<dumps::DumpFile>()?;
    m.add_function(wrap_pyfunction!(reference, m)?)?;
    m.add_function(wrap_pyfunction!(plan, m)?)?;
    m.add_function(wrap_pyfunction!(check, m)?)?;
    m.add_function(wrap_pyfunction!(dumps::save_dump, m)?)?;
    m.add_function(wrap_pyfunction!(dumps::load_dump, m)?)?;
    m.add_function(wrap_pyfunction!(dumps::replay, m)?)?;
    m.add_function(wrap_pyfunction!(_panic_for_tests, m)?)?;
    m.add_function(wrap_pyfunction!(_input_pointers, m)?)?;
    m.add_function(wrap_pyfunction!(index_shapes, m)?)?;
    #[cfg(feature = "cuda")]
    {
        m.add_function(wrap_pyfunction!(cuda::decode, m)?)?;
        m.add_function(wrap_pyfunction!(cuda::decode_workspace_bytes, m)?)?;
        m.add_function(wrap_pyfunction!(cuda::index, m)?)?;
        m.add_function(wrap_pyfunction!(cuda::_pointer_hook, m)?)?;
        m.add_function(wrap_pyfunction!(cuda::_kernel_pointers, m)?)?;
        m.add_function(wrap_pyfunction!(cuda::precision_name, m)?)?;
        m.add_function(wrap_pyfunction!(cuda::row_bounds, m)?)?;
    }
    m.add("CUDA", cfg!(feature = "cuda"))?;
    Ok(())
}
