//! The CUDA entries (feature `cuda`): the decode step and the engine entry on a
//! framework's device tensors, zero copy, on its current stream.
//!
//! Each CUDA device gets one cudarc context (the driver's primary context, the one
//! torch uses) with event tracking off, and one [`Device`] whose compiled modules every
//! call shares; a call wraps the caller's stream handle (`torch.cuda.current_stream()`)
//! without owning it. The caller's tensors become cudarc slices that are never freed
//! ([`DevBuf`]): taking their pointers inserts no event, wait or synchronisation.

use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};
use dsa_indexer::cuda::{DecodeShape, Device, Engine, Hooks, Precision};
use dsa_indexer::dump::RoleKind;
use dsa_indexer::problem::Format;
use dsa_indexer::{Error, Result};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::layer::device::{DecodeLayer, DevBuf};
use crate::layer::Layer;
use crate::tensor::{bad, CurrentStream, Dt, Tensor};
use crate::{guard, to_py};

/// A slice's device address.
pub(crate) fn addr<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    let (p, _g) = s.device_ptr(stream);
    p
}

fn backend(problem: impl Into<String>) -> Error {
    Error::Backend {
        backend: "cuda",
        problem: problem.into(),
    }
}

/// CUDA device `ordinal`'s shared device (its context, its modules), opened once.
fn base(ordinal: usize) -> Result<Arc<Device>> {
    static DEVICES: Mutex<Vec<(usize, Arc<Device>)>> = Mutex::new(Vec::new());
    if !dsa_indexer::cuda::libraries_present() {
        return Err(backend(
            "no CUDA: libcuda or libnvrtc not found (driver and NVRTC 13.0 needed)",
        ));
    }
    let mut g = DEVICES
        .lock()
        .map_err(|_| backend("device table lock poisoned"))?;
    if let Some((_, d)) = g.iter().find(|(o, _)| *o == ordinal) {
        return Ok(d.clone());
    }
    let ctx = CudaContext::new(ordinal).map_err(|e| backend(format!("cuda:{ordinal}: {e:?}")))?;
    // SAFETY: no slice of this context object exists yet; every slice made on it later
    // is a caller's buffer (DevBuf, never freed) or the engine's own, used on the one
    // stream of its call, so no cross-stream tracking is needed.
    unsafe { ctx.disable_event_tracking() };
    let d = Device::with_stream(ctx.default_stream())?;
    g.push((ordinal, d.clone()));
    Ok(d)
}

/// The engine of CUDA device `ordinal` on the caller's stream handle `stream`, its
/// tolerance-class logits under `precision`.
fn engine(
    ordinal: usize,
    stream: usize,
    precision: Precision,
) -> Result<(Engine, Arc<CudaStream>)> {
    let base = base(ordinal)?;
    // SAFETY: `stream` is the caller's live stream of this device's primary context
    // (torch's current stream), alive for the call; the wrapper does not destroy it, and
    // all work of the call is queued on it, after the caller's.
    let s = unsafe {
        base.context()
            .wrap_borrowed_stream(stream as cudarc::driver::sys::CUstream)
    };
    let dev = base.on_stream(s.clone())?;
    Ok((Engine::on_device(dev).with_precision(precision), s))
}

// ==== the pointer hook ====

/// The device addresses the last CUDA call gave the kernels, when the hook is on.
static HOOK: Mutex<Option<Vec<(String, u64)>>> = Mutex::new(None);

fn record(addrs: Vec<(&'static str, u64)>) {
    if let Ok(mut g) = HOOK.lock() {
        if let Some(v) = g.as_mut() {
            *v = addrs.into_iter().map(|(n, a)| (n.to_string(), a)).collect();
        }
    }
}

/// Turn the pointer hook on (recording each CUDA call's device addresses) or off.
#[pyfunction]
pub fn _pointer_hook(on: bool) {
    if let Ok(mut g) = HOOK.lock() {
        *g = on.then(Vec::new);
    }
}

/// The device addresses the kernels of the last CUDA call received, by argument name
/// (empty when the hook is off).
#[pyfunction]
pub fn _kernel_pointers() -> Vec<(String, u64)> {
    HOOK.lock().ok().and_then(|g| g.clone()).unwrap_or_default()
}

// ==== arguments ====

/// `precision=` as a [`Precision`]: a string [`Precision::parse`] takes; anything else
/// (another string, another type) is its error naming `precision` and the value.
fn precision_arg(v: &Bound<'_, PyAny>) -> Result<Precision> {
    match v.extract::<String>() {
        Ok(name) => Precision::parse(&name),
        Err(_) => Precision::parse(&v.repr().map(|r| r.to_string()).unwrap_or_default()),
    }
}

/// An optional `precision` keyword: [`precision_arg`], or the default when absent.
fn optional_precision(v: Option<&Bound<'_, PyAny>>) -> Result<Precision> {
    v.map(precision_arg)
        .transpose()
        .map(Option::unwrap_or_default)
}

/// The name of precision `precision` (`"full"` or `"fast"`), or the crate's
/// `ValueError` naming `precision` and the value: the wrappers' check before any device
/// work.
#[pyfunction]
pub fn precision_name(precision: &Bound<'_, PyAny>) -> PyResult<&'static str> {
    guard(|| precision_arg(precision).map(Precision::name).map_err(to_py))
}

fn count(args: &Bound<'_, PyDict>, key: &str) -> PyResult<Option<usize>> {
    let Some(v) = args.get_item(key)?.filter(|v| !v.is_none()) else {
        return Ok(None);
    };
    let n: i64 = v.extract().map_err(|_| {
        to_py(Error::OutOfRange {
            field: key.into(),
            value: v.repr().map(|r| r.to_string()).unwrap_or_default(),
            expected: "an integer",
        })
    })?;
    usize::try_from(n).map(Some).map_err(|_| {
        to_py(Error::OutOfRange {
            field: key.into(),
            value: n.to_string(),
            expected: "an integer >= 0",
        })
    })
}

fn need_count(args: &Bound<'_, PyDict>, key: &str) -> PyResult<usize> {
    count(args, key)?.ok_or_else(|| to_py(bad(key, "missing")))
}

fn tensor(
    args: &Bound<'_, PyDict>,
    key: &'static str,
    s: &CurrentStream,
) -> PyResult<Option<Tensor>> {
    args.get_item(key)?
        .filter(|v| !v.is_none())
        .map(|v| Tensor::import_on(key, &v, s))
        .transpose()
}

fn need(args: &Bound<'_, PyDict>, key: &'static str, s: &CurrentStream) -> PyResult<Tensor> {
    tensor(args, key, s)?.ok_or_else(|| to_py(bad(key, "missing")))
}

/// `t` must be `dtype` of `shape`.
fn expect(t: &Tensor, dtype: Dt, shape: &[usize], what: &str) -> Result<()> {
    if t.dtype != dtype || t.shape != shape {
        return Err(t.error(format!("{} {shape:?}{what}", dtype.name())));
    }
    Ok(())
}

// ==== the decode step ====

/// One decode step (`Engine::decode_step`, then `DecodeStep::launch`) on the caller's
/// tensors `args` (`q`, `q_scale`, `weights`, `kv_cache`, `page_table`,
/// `context_lens`, the outputs `raw` and `page`, the `workspace`; `next_n`, `topk`,
/// `max_context`, `page_size`, `page_cols`, `ratio`) on stream `stream` of CUDA device
/// `ordinal`, the tolerance class's logits under `precision` (`"full"` or `"fast"`;
/// `Engine::with_precision`): nothing allocated, nothing synchronised. `check` first
/// runs the step's value checks (`Engine::decode_check`, which reads `context_lens`
/// back).
#[pyfunction]
#[pyo3(signature = (args, ordinal, stream, check, precision = None))]
pub fn decode(
    args: &Bound<'_, PyDict>,
    ordinal: usize,
    stream: usize,
    check: bool,
    precision: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    guard(|| {
        let cs = CurrentStream(stream);
        let ve = to_py;
        let precision = optional_precision(precision).map_err(ve)?;
        let q = need(args, "q", &cs)?;
        let q_scale = tensor(args, "q_scale", &cs)?;
        let weights = need(args, "weights", &cs)?;
        let kv_cache = need(args, "kv_cache", &cs)?;
        let page_table = need(args, "page_table", &cs)?;
        let context_lens = need(args, "context_lens", &cs)?;
        let raw = need(args, "raw", &cs)?;
        let page = need(args, "page", &cs)?;
        let workspace = need(args, "workspace", &cs)?;
        let next_n = need_count(args, "next_n")?;
        let topk = need_count(args, "topk")?;
        let max_context = need_count(args, "max_context")?;
        let page_size = need_count(args, "page_size")?;
        let ratio = count(args, "ratio")?.unwrap_or(1);
        let page_cols = count(args, "page_cols")?;
        if next_n == 0 {
            return Err(ve(Error::OutOfRange {
                field: "next_n".into(),
                value: "0".into(),
                expected: "1 ..= 64",
            }));
        }
        let q_desc = (q.describe(), q.shape.first().copied().unwrap_or(0));
        let layer =
            DecodeLayer::new(q, q_scale, weights, kv_cache, page_table, page_size).map_err(ve)?;
        let [b, max_pages] = layer.table_shape;
        let shape = DecodeShape {
            batch: b,
            next_n,
            max_context,
            heads: layer.heads,
            dim: layer.dim,
            q: layer.q_format,
            k: layer.k_format,
            topk,
            page_cols,
            page_size,
            max_pages,
            ratio,
        };
        let r = b.saturating_mul(next_n);
        if q_desc.1 != r {
            return Err(ve(bad(
                "q",
                format!(
                    "{}, expected [B * next_n = {r}, H, ..] (B = {b} requests from page_table, \
                     next_n = {next_n})",
                    q_desc.0
                ),
            )));
        }
        if layer.weights_shape != [r, layer.heads] {
            return Err(ve(bad(
                "weights",
                format!(
                    "shape {:?}, expected float32 [{r}, {}]",
                    layer.weights_shape, layer.heads
                ),
            )));
        }
        let w = shape.page_width();
        expect(&context_lens, Dt::I32, &[b], " (S_b of every request)").map_err(ve)?;
        expect(&raw, Dt::I32, &[r, topk], " [B * next_n, topk]").map_err(ve)?;
        expect(&page, Dt::I32, &[r, w], " [B * next_n, page_cols]").map_err(ve)?;
        if workspace.dtype != Dt::U8 || workspace.shape.len() != 1 {
            return Err(ve(workspace.error(
                "uint8 [n] with n >= dsa_indexer.decode_workspace_bytes(...)",
            )));
        }
        let (engine, s) = engine(ordinal, stream, precision).map_err(ve)?;
        let bufs = layer.on_device(&s, ordinal).map_err(ve)?;
        let lens = DevBuf::<i32>::new(&context_lens, &s, ordinal).map_err(ve)?;
        let mut raw_b = DevBuf::<i32>::new(&raw, &s, ordinal).map_err(ve)?;
        let mut page_b = DevBuf::<i32>::new(&page, &s, ordinal).map_err(ve)?;
        let mut ws_b = DevBuf::<u8>::new(&workspace, &s, ordinal).map_err(ve)?;
        let mut addrs = bufs.addrs();
        addrs.extend([
            ("context_lens", lens.addr()),
            ("raw", raw_b.addr()),
            ("page", page_b.addr()),
            ("workspace", ws_b.addr()),
        ]);
        let inputs = bufs.inputs(lens.view());
        if check {
            engine.decode_check(&shape, &inputs).map_err(ve)?;
        }
        let (mut rv, mut pv, mut wv) = (raw_b.view_mut(), page_b.view_mut(), ws_b.view_mut());
        let step = engine
            .decode_step(&shape, &inputs, &mut rv, &mut pv, &mut wv)
            .map_err(ve)?;
        record(addrs);
        step.launch().map_err(ve)
    })
}

/// Bytes of workspace a decode step takes: `shape` as the step's arguments give it
/// (`q`'s shape and whether it is packed fp4, `kv_cache`'s and `page_table`'s shapes)
/// on a GPU of `sms` SMs (`None`: CUDA device `ordinal`'s).
#[pyfunction]
#[pyo3(signature = (q_shape, q_packed, kv_shape, table_shape, next_n, topk, max_context, page_size, page_cols, ratio, sms, ordinal))]
#[allow(clippy::too_many_arguments)]
pub fn decode_workspace_bytes(
    q_shape: Vec<usize>,
    q_packed: bool,
    kv_shape: Vec<usize>,
    table_shape: Vec<usize>,
    next_n: usize,
    topk: usize,
    max_context: usize,
    page_size: usize,
    page_cols: Option<usize>,
    ratio: usize,
    sms: Option<usize>,
    ordinal: usize,
) -> PyResult<usize> {
    guard(|| {
        let shape = decode_shape(
            &q_shape,
            q_packed,
            &kv_shape,
            &table_shape,
            [next_n, topk, max_context, page_size, ratio],
            page_cols,
        )
        .map_err(to_py)?;
        let sms = match sms {
            Some(n) if n > 0 => n,
            Some(n) => {
                return Err(to_py(Error::OutOfRange {
                    field: "sms".into(),
                    value: n.to_string(),
                    expected: "at least 1",
                }))
            }
            None => base(ordinal).map_err(to_py)?.sm_count(),
        };
        Ok(dsa_indexer::cuda::decode_workspace_bytes(&shape, sms))
    })
}

/// The decode shape from the arguments' shapes: `D` from `q` (twice its last
/// dimension when packed), the key format from the page width, `B` and `max_pages`
/// from the page table.
fn decode_shape(
    q_shape: &[usize],
    q_packed: bool,
    kv_shape: &[usize],
    table_shape: &[usize],
    [next_n, topk, max_context, page_size, ratio]: [usize; 5],
    page_cols: Option<usize>,
) -> Result<DecodeShape> {
    let &[_, heads, last] = q_shape else {
        return Err(bad(
            "q",
            format!("shape {q_shape:?}, expected [B * next_n, H, ..]"),
        ));
    };
    let &[batch, max_pages] = table_shape else {
        return Err(bad(
            "page_table",
            format!("shape {table_shape:?}, expected [B, max_pages]"),
        ));
    };
    let dim = if q_packed { last * 2 } else { last };
    let width = kv_shape
        .get(1..)
        .map(|w| w.iter().product::<usize>())
        .unwrap_or(0);
    let bpt = |f| page_size.saturating_mul(dsa_indexer::paged::bytes_per_token(f, dim));
    let k = if width == bpt(Format::E4m3) {
        Format::E4m3
    } else if width == bpt(Format::E2m1) {
        Format::E2m1
    } else {
        return Err(bad(
            "kv_cache",
            format!(
                "shape {kv_shape:?}: pages of {width} bytes are neither E4M3 keys ({}) nor fp4 \
                 keys ({}) of D = {dim}, page_size {page_size}",
                bpt(Format::E4m3),
                bpt(Format::E2m1)
            ),
        ));
    };
    Ok(DecodeShape {
        batch,
        next_n,
        max_context,
        heads,
        dim,
        q: if q_packed { Format::E2m1 } else { Format::E4m3 },
        k,
        topk,
        page_cols,
        page_size,
        max_pages,
        ratio,
    })
}

// ==== the engine entry ====

/// One layer-forward through `Engine::prepare_device` and `DeviceRun::launch` on the
/// caller's device tensors (`args`: `reference`'s arguments, the index arguments on the
/// host) on stream `stream` of CUDA device `ordinal`, writing into `raw`, `page` and, for
/// a source layer, `published` (the caller's tensors). Its workspace is the tensor that
/// `workspace(nbytes)` returns (a uint8 CUDA tensor of at least `nbytes` bytes, from the
/// framework's allocator): the call allocates no device memory of its own. The value
/// checks wait once for the stream. The tolerance class's logits run under `precision`
/// (`"full"` or `"fast"`; `Engine::with_precision`).
#[pyfunction]
#[pyo3(signature = (args, raw, page, published, workspace, budget, ordinal, stream, precision = None))]
#[allow(clippy::too_many_arguments)]
pub fn index(
    args: &Bound<'_, PyDict>,
    raw: &Bound<'_, PyAny>,
    page: &Bound<'_, PyAny>,
    published: Option<&Bound<'_, PyAny>>,
    workspace: &Bound<'_, PyAny>,
    budget: i64,
    ordinal: usize,
    stream: usize,
    precision: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    guard(|| {
        let cs = CurrentStream(stream);
        let ve = to_py;
        let precision = optional_precision(precision).map_err(ve)?;
        let layer = Layer::from_dict_on_device(args, &cs)?;
        let budget = crate::bytes_arg("budget", budget)?;
        let parts = layer.parts().map_err(ve)?;
        let batch = &parts.batch;
        let m = &layer.meta;
        let t = batch.num_rows();
        let params = layer.params();
        let cols = params.page_cols.unwrap_or(params.topk.div_ceil(64) * 64);
        let tail = (m.role == RoleKind::Source).then_some(m.tail);
        let raw = Tensor::import_on("raw", raw, &cs)?;
        let page = Tensor::import_on("page", page, &cs)?;
        expect(&raw, Dt::I32, &[t, params.topk], " [T, topk]").map_err(ve)?;
        expect(&page, Dt::I32, &[t, cols], " [T, page_cols]").map_err(ve)?;
        let published = match (published, tail) {
            (Some(p), Some(tail)) => {
                let p = Tensor::import_on("published", p, &cs)?;
                let rows = (0..t)
                    .filter(|&i| {
                        dsa_indexer::batch::publishes(&batch.rows()[i], batch.requests(), tail)
                    })
                    .count();
                expect(&p, Dt::I32, &[rows, m.num_blocks], " [P, num_blocks]").map_err(ve)?;
                Some(p)
            }
            (None, Some(_)) => return Err(ve(bad("published", "missing (role = source)"))),
            (_, None) => None,
        };
        let (engine, s) = engine(ordinal, stream, precision).map_err(ve)?;
        let dl = layer.on_device(&s, ordinal).map_err(ve)?;
        let mut raw_b = DevBuf::<i32>::new(&raw, &s, ordinal).map_err(ve)?;
        let mut page_b = DevBuf::<i32>::new(&page, &s, ordinal).map_err(ve)?;
        let mut pub_b = match &published {
            Some(p) => Some(DevBuf::<i32>::new(p, &s, ordinal).map_err(ve)?),
            None => None,
        };
        let inputs = dl.inputs();
        let cands = dl.candidates();
        let run = engine
            .prepare_device(batch, &inputs, params, tail, cands.as_ref(), budget)
            .map_err(ve)?;
        let nbytes = run.workspace_bytes();
        let ws_obj = workspace.call1((nbytes,))?;
        let ws = Tensor::import_on("workspace", &ws_obj, &cs)?;
        if ws.dtype != Dt::U8 || ws.shape.len() != 1 || ws.shape[0] < nbytes {
            return Err(ve(ws.error(format!("uint8 [n] with n >= {nbytes}"))));
        }
        let mut ws_b = DevBuf::<u8>::new(&ws, &s, ordinal).map_err(ve)?;
        let mut addrs = dl.addrs();
        addrs.extend([
            ("raw", raw_b.addr()),
            ("page", page_b.addr()),
            ("workspace", ws_b.addr()),
        ]);
        if let Some(b) = &pub_b {
            addrs.push(("published", b.addr()));
        }
        let (mut rv, mut pv, mut wv) = (raw_b.view_mut(), page_b.view_mut(), ws_b.view_mut());
        let mut pubv = pub_b.as_mut().map(|b| b.view_mut());
        run.launch(&mut rv, &mut pv, pubv.as_mut(), &mut wv)
            .map_err(ve)?;
        // What the backend allocated itself during the call (its device is this call's):
        // 0, every buffer being the caller's.
        addrs.push(("backend_allocated_bytes", engine.allocated_bytes()));
        addrs.push(("workspace_bytes", nbytes as u64));
        record(addrs);
        Ok(())
    })
}

// ==== the stated bound ====

/// Per row of the layer `args` (host arrays, `reference`'s arguments): the largest
/// bound this backend states for its logits at `precision` over the row's visible keys
/// (`cuda::logit_bound` with SPEC 4's `M`, under no test hooks, as the CUDA entries
/// run), one float per row: SPEC 5's "row's largest bound" of a tolerance-class layer. No
/// GPU needed. A list of floats.
#[pyfunction]
#[pyo3(signature = (args, precision))]
pub fn row_bounds(
    py: Python<'_>,
    args: &Bound<'_, PyDict>,
    precision: &Bound<'_, PyAny>,
) -> PyResult<Vec<f64>> {
    guard(|| {
        let precision = precision_arg(precision).map_err(to_py)?;
        let layer = Layer::from_dict(args)?;
        let parts = layer.parts().map_err(to_py)?;
        let p = layer.problem(&parts).map_err(to_py)?;
        let t = p.batch.num_rows();
        let bounds = py.detach(|| {
            use rayon::prelude::*;
            (0..t)
                .into_par_iter()
                .map(|i| {
                    dsa_indexer::verdict::bound::magnitudes(&p, i)
                        .into_iter()
                        .enumerate()
                        .map(|(j, m)| {
                            dsa_indexer::cuda::logit_bound(&p, i, j, m, Hooks::default(), precision)
                        })
                        .fold(0.0, f64::max)
                })
                .collect()
        });
        Ok(bounds)
    })
}
