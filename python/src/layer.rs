//! One layer-forward's arguments as Python gives them (a dict built by the Python
//! wrapper), checked against SPEC 9's dtypes and turned into the library's views.
//!
//! The formats follow from the arguments: queries with no `q_scale` are E4M3 (their
//! scale is folded into the weights, SPEC 4), with one packed fp4; keys whose
//! `k_scale` is `float32` are E4M3, any other `k_scale` (UE8M0 bytes or `int32` words)
//! makes them packed fp4. Paged keys (SPEC 10: `kv_cache`, `page_table` and
//! `page_size` instead of `k` and `k_scale`) take their format from the page width.
//! Codes, packed fp4, UE8M0 bytes, `float32` weights and key scales, the `uint8` page
//! pool, `int32` slots and page tables are borrowed from the caller's buffers;
//! `bfloat16` weights, `int32` scale words of `D < 128`, `int64` indices and the small
//! index tensors are converted.

use dsa_indexer::batch::Batch;
use dsa_indexer::dump::{Dump, Expected, KData, Layout, Meta, QData, RoleKind};
use dsa_indexer::paged::{bytes_per_token, PagedKeys, MAX_PAGE_SIZE};
use dsa_indexer::problem::{Format, Inputs, Keys, Params, Problem, Published, Queries, Role};
use dsa_indexer::{Error, Result};
use ndarray::{Array2, ArrayView1, ArrayView2, ArrayView3};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::tensor::{bad, CurrentStream, Dt, Tensor};

/// Bytes: the caller's buffer, or converted.
enum Bytes {
    View(Tensor),
    Owned(Vec<u8>),
}

impl Bytes {
    fn get(&self) -> Result<&[u8]> {
        match self {
            Bytes::View(t) => t.bytes(),
            Bytes::Owned(v) => Ok(v),
        }
    }
}

/// `f32` values: the caller's buffer, or converted.
enum Floats {
    View(Tensor),
    Owned(Vec<f32>),
}

impl Floats {
    fn of(t: Tensor) -> Result<Floats> {
        match t.dtype {
            Dt::F32 => Ok(Floats::View(t)),
            _ => Ok(Floats::Owned(t.floats()?.as_slice().to_vec())),
        }
    }
    fn get(&self) -> Result<&[f32]> {
        match self {
            Floats::View(t) => t.slice::<f32>(),
            Floats::Owned(v) => Ok(v),
        }
    }
}

/// `i32` values: the caller's buffer, or converted.
enum Ints {
    View(Tensor),
    Owned(Vec<i32>),
}

impl Ints {
    fn of(t: Tensor) -> Result<Ints> {
        match t.dtype {
            Dt::I32 => Ok(Ints::View(t)),
            _ => Ok(Ints::Owned(t.i32s()?.as_slice().to_vec())),
        }
    }
    fn get(&self) -> Result<&[i32]> {
        match self {
            Ints::View(t) => t.slice::<i32>(),
            Ints::Owned(v) => Ok(v),
        }
    }
}

/// A tensor's bytes and the shape the library reads them as.
struct Shaped {
    bytes: Bytes,
    shape: Vec<usize>,
}

enum Q {
    E4m3(Shaped),
    E2m1 { packed: Shaped, scale: Shaped },
}

enum K {
    E4m3 {
        codes: Shaped,
        scale: Floats,
        len: usize,
    },
    E2m1 {
        packed: Shaped,
        scale: Shaped,
    },
    /// SPEC 10: the pool as `[num_pages, page bytes]` and the table `[B, max_pages]`.
    Paged {
        kv_cache: Shaped,
        page_table: Ints,
        table_shape: [usize; 2],
        page_size: usize,
    },
}

/// One layer-forward's arguments, checked and ready to view.
pub struct Layer {
    /// Scalars, as a dump states them.
    pub meta: Meta,
    /// `S_b`.
    pub seq_lens: Vec<usize>,
    /// The rows.
    pub layout: Layout,
    q: Q,
    k: K,
    weights: Floats,
    weights_shape: [usize; 2],
    k_slots: Option<Ints>,
    candidates: Option<Array2<i32>>,
    /// A consumer's candidates left where they are (a device tensor), for
    /// [`Layer::from_dict_on_device`].
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    device_candidates: Option<Tensor>,
}

/// The batch and the consumer's candidates of a [`Layer`], which its problem borrows.
pub struct Parts {
    /// The batch.
    pub batch: Batch,
    published: Option<Published>,
}

/// The arguments dict, read key by key; a key the package does not know is an error.
struct Args<'a, 'py> {
    d: &'a Bound<'py, PyDict>,
    /// The stream device tensors are imported for (the CUDA entries).
    stream: Option<&'a CurrentStream>,
}

const KEYS: [&str; 21] = [
    "q",
    "q_scale",
    "k",
    "k_scale",
    "weights",
    "seq_lens",
    "query_starts",
    "row_requests",
    "row_positions",
    "topk",
    "ratio",
    "role",
    "tail",
    "block_size",
    "num_blocks",
    "candidates",
    "page_cols",
    "k_slots",
    "kv_cache",
    "page_table",
    "page_size",
];

impl<'py> Args<'_, 'py> {
    fn get(&self, key: &str) -> PyResult<Option<Bound<'py, PyAny>>> {
        Ok(self.d.get_item(key)?.filter(|v| !v.is_none()))
    }

    fn tensor(&self, key: &'static str) -> PyResult<Option<Tensor>> {
        self.get(key)?
            .map(|v| match self.stream {
                Some(s) => Tensor::import_on(key, &v, s),
                None => Tensor::import(key, &v),
            })
            .transpose()
    }

    fn need(&self, key: &'static str) -> PyResult<Tensor> {
        self.tensor(key)?
            .ok_or_else(|| crate::to_py(bad(key, "missing")))
    }

    /// A non-negative integer argument.
    fn count(&self, key: &'static str) -> PyResult<Option<usize>> {
        let Some(v) = self.get(key)? else {
            return Ok(None);
        };
        let n: i64 = v.extract().map_err(|_| {
            crate::to_py(Error::OutOfRange {
                field: key.into(),
                value: v.repr().map(|r| r.to_string()).unwrap_or_default(),
                expected: "an integer",
            })
        })?;
        usize::try_from(n).map(Some).map_err(|_| {
            crate::to_py(Error::OutOfRange {
                field: key.into(),
                value: n.to_string(),
                expected: "an integer >= 0",
            })
        })
    }
}

/// `dim` from the packed width, an error in the library's words when it is not one
/// SPEC 4 allows (the scale words' width depends on it).
fn groups(dim: usize) -> Result<usize> {
    if [32, 64, 128].contains(&dim) {
        Ok(dim / 32)
    } else {
        Err(Error::OutOfRange {
            field: "dim".into(),
            value: dim.to_string(),
            expected: "32, 64 or 128",
        })
    }
}

/// Packed fp4 `[.., D/2]` bytes (or `float4_e2m1fn` `[.., D]` values): bytes, their
/// shape, and `D`.
fn packed(t: Tensor, ndim: usize, want: &str) -> Result<(Shaped, usize)> {
    if t.shape.len() != ndim || !matches!(t.dtype, Dt::U8 | Dt::I8 | Dt::F4x2 | Dt::F4) {
        return Err(t.error(want));
    }
    let mut shape = t.shape.clone();
    let last = shape[ndim - 1];
    let dim = if t.dtype == Dt::F4 {
        if !last.is_multiple_of(2) {
            return Err(t.error("an even number of float4_e2m1fn values a row"));
        }
        shape[ndim - 1] = last / 2;
        last
    } else {
        last.saturating_mul(2)
    };
    Ok((
        Shaped {
            bytes: Bytes::View(t),
            shape,
        },
        dim,
    ))
}

/// UE8M0 scales `[lead.., G]` from bytes (`uint8`, `float8_e8m0fnu`) or from `int32`
/// words `[lead..]` (byte `g` = group `g`).
fn scales(t: Tensor, lead: &[usize], g: usize) -> Result<Shaped> {
    let want = [lead, &[g]].concat();
    match t.dtype {
        Dt::U8 | Dt::F8E8m0 => {
            if t.shape.len() != want.len() {
                return Err(t.error(format!("UE8M0 bytes {want:?}")));
            }
            Ok(Shaped {
                shape: t.shape.clone(),
                bytes: Bytes::View(t),
            })
        }
        Dt::I32 => {
            if t.shape != lead && t.shape != [lead, &[1]].concat() {
                return Err(t.error(format!("int32 words {lead:?}, or UE8M0 bytes {want:?}")));
            }
            let bytes = if g == 4 {
                // The words' little-endian bytes are the [.., 4] scale bytes.
                Bytes::View(t)
            } else {
                let w = t.bytes()?;
                Bytes::Owned(w.chunks_exact(4).flat_map(|c| c[..g].to_vec()).collect())
            };
            Ok(Shaped { bytes, shape: want })
        }
        _ => Err(t.error(format!(
            "UE8M0 bytes {want:?} (uint8, float8_e8m0fnu) or int32 words {lead:?}"
        ))),
    }
}

fn queries(q: Tensor, q_scale: Option<Tensor>) -> Result<(Q, Format, usize, usize)> {
    const WANT: &str = "float8_e4m3fn or uint8 E4M3 codes [T, H, D] (no q_scale), \
                        or packed fp4 (uint8, int8, float4_e2m1fn_x2) [T, H, D/2] with q_scale";
    if q.shape.len() != 3 {
        return Err(q.error(WANT));
    }
    let (t, h) = (q.shape[0], q.shape[1]);
    match (q.dtype, q_scale) {
        (Dt::F8E4m3 | Dt::U8, None) => {
            let dim = q.shape[2];
            Ok((
                Q::E4m3(Shaped {
                    shape: q.shape.clone(),
                    bytes: Bytes::View(q),
                }),
                Format::E4m3,
                h,
                dim,
            ))
        }
        (Dt::F8E4m3, Some(_)) => Err(bad(
            "q_scale",
            "given with float8_e4m3fn queries, which have none: fold the query scale into \
             the weights (SPEC 4)",
        )),
        (Dt::I8 | Dt::F4x2 | Dt::F4, None) => Err(bad(
            "q_scale",
            format!(
                "missing: packed fp4 queries (q dtype {}) need their UE8M0 scales",
                q.dtype.name()
            ),
        )),
        (_, Some(s)) => {
            let (packed, dim) = packed(q, 3, WANT)?;
            let scale = scales(s, &[t, h], groups(dim)?)?;
            Ok((Q::E2m1 { packed, scale }, Format::E2m1, h, dim))
        }
        (_, None) => Err(q.error(WANT)),
    }
}

fn keys(k: Tensor, k_scale: Tensor, dim: usize) -> Result<(K, Format)> {
    if k.shape.len() != 2 {
        return Err(k.error(format!(
            "E4M3 codes [L, {dim}] with a float32 k_scale [L], or packed fp4 [L, {}] with \
             UE8M0 k_scale (D = {dim}, from q)",
            dim / 2
        )));
    }
    let l = k.shape[0];
    let want = format!(
        "E4M3 codes (float8_e4m3fn, uint8) [{l}, {dim}] with a float32 k_scale [{l}], or packed \
         fp4 (uint8, int8, float4_e2m1fn_x2) [{l}, {}] with UE8M0 k_scale (D = {dim}, from q)",
        dim / 2
    );
    match (k.dtype, k_scale.dtype) {
        (Dt::F8E4m3 | Dt::U8, Dt::F32) => {
            if k_scale.shape != [l] && k_scale.shape != [l, 1] {
                return Err(k_scale.error(format!("float32 [{l}] (one scale per key)")));
            }
            let len = k_scale.shape[0];
            Ok((
                K::E4m3 {
                    codes: Shaped {
                        shape: k.shape.clone(),
                        bytes: Bytes::View(k),
                    },
                    scale: Floats::of(k_scale)?,
                    len,
                },
                Format::E4m3,
            ))
        }
        (Dt::F8E4m3, _) => Err(k_scale.error(format!("float32 [{l}] for float8_e4m3fn keys"))),
        (_, Dt::F32) => Err(k.error(want)),
        _ => {
            // Packed fp4 must be as wide as q's D (a uint8 buffer could be either format).
            let kdim = if k.dtype == Dt::F4 {
                k.shape[1]
            } else {
                k.shape[1].saturating_mul(2)
            };
            if kdim != dim {
                return Err(k.error(want));
            }
            let (packed, _) = packed(k, 2, &want)?;
            let scale = scales(k_scale, &[l], groups(dim)?)?;
            Ok((K::E2m1 { packed, scale }, Format::E2m1))
        }
    }
}

/// Paged keys (SPEC 10): `kv_cache` `uint8 [num_pages, P * bytes_per_token]` (or
/// `[num_pages, ..]`, the trailing dimensions one page, as DeepGEMM's
/// `[num_pages, P, 1, bytes_per_token]`), `page_table` `int32 [B, max_pages]` and
/// `page_size` `P`. The key format follows from the page width: `P * (D + 4)` bytes are
/// E4M3 keys with f32 scales, `P * (D/2 + D/32)` packed fp4 with UE8M0 scales.
fn paged_keys(
    kv_cache: Tensor,
    page_table: Tensor,
    page_size: usize,
    dim: usize,
) -> Result<(K, Format)> {
    if kv_cache.dtype != Dt::U8 || kv_cache.shape.len() < 2 {
        return Err(kv_cache.error("uint8 [num_pages, page_size * bytes_per_token]"));
    }
    let pages = kv_cache.shape[0];
    let width = kv_cache.shape[1..]
        .iter()
        .try_fold(1usize, |a, &x| a.checked_mul(x))
        .ok_or_else(|| bad("kv_cache", "the page width overflows usize"))?;
    let e4m3 = page_size.saturating_mul(bytes_per_token(Format::E4m3, dim));
    let e2m1 = page_size.saturating_mul(bytes_per_token(Format::E2m1, dim));
    let format = if width == e4m3 {
        Format::E4m3
    } else if width == e2m1 {
        Format::E2m1
    } else if !(page_size.is_power_of_two() && page_size <= MAX_PAGE_SIZE) {
        // The library names the page size.
        Format::E4m3
    } else {
        return Err(kv_cache.error(format!(
            "uint8 [num_pages, {e4m3}] (E4M3 keys: page_size {page_size} x (D + 4) bytes) or \
             [num_pages, {e2m1}] (fp4 keys: page_size {page_size} x (D/2 + D/32) bytes), \
             D = {dim} from q"
        )));
    };
    if page_table.shape.len() != 2 {
        return Err(page_table.error("int32 [B, max_pages] page ids"));
    }
    let table_shape = [page_table.shape[0], page_table.shape[1]];
    let page_table = Ints::of(page_table)?;
    Ok((
        K::Paged {
            kv_cache: Shaped {
                bytes: Bytes::View(kv_cache),
                shape: vec![pages, width],
            },
            page_table,
            table_shape,
            page_size,
        },
        format,
    ))
}

/// The keys, flat (`k`, `k_scale`) or paged (`kv_cache`, `page_table`, `page_size`):
/// one of the two sets, whole.
fn any_keys(a: &Args, dim: usize) -> PyResult<(K, Format)> {
    let ve = crate::to_py;
    let flat = [a.tensor("k")?, a.tensor("k_scale")?];
    let paged = [a.tensor("kv_cache")?, a.tensor("page_table")?];
    let page_size = a.count("page_size")?;
    let any_flat = flat.iter().any(Option::is_some);
    let any_paged = paged.iter().any(Option::is_some) || page_size.is_some();
    match (any_flat, any_paged) {
        (true, true) => {
            let f = if flat[0].is_some() { "k" } else { "k_scale" };
            let p = match (&paged[0], &paged[1]) {
                (Some(_), _) => "kv_cache",
                (None, Some(_)) => "page_table",
                (None, None) => "page_size",
            };
            Err(ve(bad(
                p,
                format!(
                    "given with {f}: keys are flat (k, k_scale) or paged (kv_cache, \
                     page_table, page_size), not both"
                ),
            )))
        }
        (false, false) => Err(ve(bad(
            "k",
            "missing: give flat keys (k, k_scale) or paged keys (kv_cache, page_table, \
             page_size)",
        ))),
        (true, false) => {
            let [k, k_scale] = flat;
            let k = k.ok_or_else(|| ve(bad("k", "missing (k_scale is given)")))?;
            let k_scale = k_scale.ok_or_else(|| ve(bad("k_scale", "missing (k is given)")))?;
            keys(k, k_scale, dim).map_err(ve)
        }
        (false, true) => {
            let [kv, table] = paged;
            let why = "missing (paged keys take kv_cache, page_table and page_size)";
            let kv = kv.ok_or_else(|| ve(bad("kv_cache", why)))?;
            let table = table.ok_or_else(|| ve(bad("page_table", why)))?;
            let p = page_size.ok_or_else(|| ve(bad("page_size", why)))?;
            paged_keys(kv, table, p, dim).map_err(ve)
        }
    }
}

fn view3<'a>(name: &str, s: &'a Shaped) -> Result<ArrayView3<'a, u8>> {
    let b = s.bytes.get()?;
    ArrayView3::from_shape((s.shape[0], s.shape[1], s.shape[2]), b)
        .map_err(|e| bad(name, format!("{} bytes as {:?}: {e}", b.len(), s.shape)))
}

fn view2<'a>(name: &str, s: &'a Shaped) -> Result<ArrayView2<'a, u8>> {
    let b = s.bytes.get()?;
    ArrayView2::from_shape((s.shape[0], s.shape[1]), b)
        .map_err(|e| bad(name, format!("{} bytes as {:?}: {e}", b.len(), s.shape)))
}

/// The rows: `query_starts`, or `row_requests` with `row_positions`; `T` rows of a
/// contiguous layout are checked against `q` before they are materialised.
fn layout(a: &Args, seq_lens: &[usize], t: usize) -> PyResult<Layout> {
    match (
        a.tensor("query_starts")?,
        a.tensor("row_requests")?,
        a.tensor("row_positions")?,
    ) {
        (Some(qs), None, None) => {
            let q0 = qs.counts().map_err(crate::to_py)?;
            let rows = seq_lens
                .iter()
                .zip(&q0)
                .try_fold(0usize, |n, (&s, &q)| n.checked_add(s.saturating_sub(q)));
            if q0.len() == seq_lens.len() && rows != Some(t) {
                return Err(crate::to_py(bad(
                    "query_starts",
                    format!(
                        "seq_lens - query_starts sum to {} rows, q has {t}",
                        rows.map_or("more than usize::MAX".into(), |r| r.to_string())
                    ),
                )));
            }
            Ok(Layout::Contiguous(q0))
        }
        (None, Some(rr), Some(rp)) => Ok(Layout::Explicit {
            requests: rr.counts().map_err(crate::to_py)?,
            positions: rp.counts().map_err(crate::to_py)?,
        }),
        _ => Err(crate::to_py(bad(
            "query_starts",
            "expected either query_starts, or both row_requests and row_positions",
        ))),
    }
}

fn role(a: &Args) -> PyResult<RoleKind> {
    let Some(v) = a.get("role")? else {
        return Ok(RoleKind::Plain);
    };
    match v.extract::<String>().ok().as_deref() {
        Some("plain") => Ok(RoleKind::Plain),
        Some("source") => Ok(RoleKind::Source),
        Some("consumer") => Ok(RoleKind::Consumer),
        _ => Err(crate::to_py(Error::OutOfRange {
            field: "role".into(),
            value: v.repr().map(|r| r.to_string()).unwrap_or_default(),
            expected: "\"plain\", \"source\" or \"consumer\"",
        })),
    }
}

impl Layer {
    /// Read and check the arguments dict.
    pub fn from_dict(d: &Bound<'_, PyDict>) -> PyResult<Layer> {
        Layer::from_dict_as(d, None)
    }

    /// [`Layer::from_dict`] for tensors on a CUDA device, imported for work on
    /// `stream`: a consumer's `candidates` stay on the device (int32 `[T, NB]`), not
    /// read to the host.
    #[cfg(feature = "cuda")]
    pub fn from_dict_on_device(d: &Bound<'_, PyDict>, stream: &CurrentStream) -> PyResult<Layer> {
        Layer::from_dict_as(d, Some(stream))
    }

    fn from_dict_as(d: &Bound<'_, PyDict>, stream: Option<&CurrentStream>) -> PyResult<Layer> {
        let on_device = stream.is_some();
        for k in d.keys() {
            let k: String = k.extract()?;
            if !KEYS.contains(&k.as_str()) {
                return Err(crate::to_py(bad(&k, "not an argument of the layer")));
            }
        }
        let a = Args { d, stream };
        let ve = crate::to_py;
        let (q, qfmt, heads, dim) = queries(a.need("q")?, a.tensor("q_scale")?).map_err(ve)?;
        let (k, kfmt) = any_keys(&a, dim)?;
        let w = a.need("weights")?;
        if w.shape.len() != 2 {
            return Err(ve(w.error("float32 or bfloat16 [T, H]")));
        }
        let weights_shape = [w.shape[0], w.shape[1]];
        let weights = Floats::of(w).map_err(ve)?;
        let seq_lens = a.need("seq_lens")?.counts().map_err(ve)?;
        let t = match &q {
            Q::E4m3(s) | Q::E2m1 { packed: s, .. } => s.shape[0],
        };
        let layout = layout(&a, &seq_lens, t)?;
        let role = role(&a)?;
        let tail = a.count("tail")?;
        if tail.is_some() && role != RoleKind::Source {
            return Err(ve(bad(
                "tail",
                "given for a layer that publishes nothing (role = \"source\" publishes)",
            )));
        }
        let mut device_candidates = None;
        let candidates = match a.tensor("candidates")? {
            Some(c) if role == RoleKind::Consumer && on_device => {
                if c.shape.len() != 2 || c.dtype != Dt::I32 {
                    return Err(ve(c.error("int32 [T, NB] block ids")));
                }
                device_candidates = Some(c);
                None
            }
            Some(c) if role == RoleKind::Consumer => {
                if c.shape.len() != 2 {
                    return Err(ve(c.error("int32 [T, NB] block ids")));
                }
                let v = c.i32s().map_err(ve)?.as_slice().to_vec();
                Some(
                    Array2::from_shape_vec((c.shape[0], c.shape[1]), v)
                        .map_err(|e| ve(bad("candidates", e.to_string())))?,
                )
            }
            Some(_) => {
                return Err(ve(bad(
                    "candidates",
                    "given for a layer that is not a consumer (role = \"consumer\")",
                )))
            }
            None if role == RoleKind::Consumer => {
                return Err(ve(bad("candidates", "missing (role = consumer)")))
            }
            None => None,
        };
        let k_slots = match a.tensor("k_slots")? {
            Some(s) if s.shape.len() == 1 => Some(Ints::of(s).map_err(ve)?),
            Some(s) => return Err(ve(s.error("int32 [L]"))),
            None => None,
        };
        let topk = a.count("topk")?.ok_or_else(|| ve(bad("topk", "missing")))?;
        let meta = Meta {
            heads,
            dim,
            topk,
            ratio: a.count("ratio")?.unwrap_or(1),
            q_format: qfmt,
            k_format: kfmt,
            role,
            block_size: a.count("block_size")?.unwrap_or(8),
            num_blocks: a.count("num_blocks")?.unwrap_or(2048),
            page_cols: a.count("page_cols")?,
            tail,
            next_n: None,
            description: String::new(),
        };
        Ok(Layer {
            meta,
            seq_lens,
            layout,
            q,
            k,
            weights,
            weights_shape,
            k_slots,
            candidates,
            device_candidates,
        })
    }

    /// Views of the inputs (shapes are checked by `Problem::new`).
    pub fn inputs(&self) -> Result<Inputs<'_>> {
        let q = match &self.q {
            Q::E4m3(s) => Queries::E4m3(view3("q", s)?),
            Q::E2m1 { packed, scale } => Queries::E2m1 {
                packed: view3("q", packed)?,
                scale: view3("q_scale", scale)?,
            },
        };
        let k = match &self.k {
            K::E4m3 { codes, scale, len } => Keys::E4m3 {
                codes: view2("k", codes)?,
                scale: ArrayView1::from_shape(*len, scale.get()?)
                    .map_err(|e| bad("k_scale", e.to_string()))?,
            },
            K::E2m1 { packed, scale } => Keys::E2m1 {
                packed: view2("k", packed)?,
                scale: view2("k_scale", scale)?,
            },
            K::Paged {
                kv_cache,
                page_table,
                table_shape,
                page_size,
            } => Keys::Paged(PagedKeys {
                format: self.meta.k_format,
                kv_cache: view2("kv_cache", kv_cache)?,
                page_table: ArrayView2::from_shape(
                    (table_shape[0], table_shape[1]),
                    page_table.get()?,
                )
                .map_err(|e| bad("page_table", e.to_string()))?,
                page_size: *page_size,
            }),
        };
        let [t, h] = self.weights_shape;
        let weights = ArrayView2::from_shape((t, h), self.weights.get()?)
            .map_err(|e| bad("weights", e.to_string()))?;
        let k_slots = match &self.k_slots {
            Some(s) => Some(ArrayView1::from(s.get()?)),
            None => None,
        };
        Ok(Inputs {
            q,
            k,
            weights,
            k_slots,
        })
    }

    /// The batch and the consumer's candidates.
    pub fn parts(&self) -> Result<Parts> {
        let batch = match &self.layout {
            Layout::Contiguous(q0) => Batch::contiguous(&self.seq_lens, q0, self.meta.ratio)?,
            Layout::Explicit {
                requests,
                positions,
            } => Batch::explicit(&self.seq_lens, requests, positions, self.meta.ratio)?,
        };
        let published = self
            .candidates
            .as_ref()
            .map(|c| Published::for_batch(&batch, self.meta.block_size, c.clone()));
        Ok(Parts { batch, published })
    }

    /// The layer's parameters.
    pub fn params(&self) -> Params {
        let m = &self.meta;
        Params {
            topk: m.topk,
            page_cols: m.page_cols,
            block_size: m.block_size,
            num_blocks: m.num_blocks,
        }
    }

    /// The validated problem over `parts` (from [`Layer::parts`]).
    pub fn problem<'s>(&'s self, parts: &'s Parts) -> Result<Problem<'s>> {
        let m = &self.meta;
        let role = match (m.role, &parts.published) {
            (RoleKind::Plain, _) => Role::Plain,
            (RoleKind::Source, _) => Role::Source { tail: m.tail },
            (RoleKind::Consumer, Some(p)) => Role::Consumer(p),
            (RoleKind::Consumer, None) => {
                return Err(bad("candidates", "missing (role = consumer)"))
            }
        };
        Problem::new(&parts.batch, self.inputs()?, self.params(), role)
    }

    /// The layer as a dump (owned copies of the inputs) carrying `expected`.
    pub fn to_dump(
        &self,
        expected: Expected,
        engine_logits: Option<Array2<f32>>,
        description: String,
    ) -> Result<Dump> {
        let i = self.inputs()?;
        let q = match i.q {
            Queries::E4m3(q) => QData::E4m3(q.to_owned()),
            Queries::E2m1 { packed, scale } => QData::E2m1 {
                packed: packed.to_owned(),
                scale: scale.to_owned(),
            },
        };
        let k = match i.k {
            Keys::E4m3 { codes, scale } => KData::E4m3 {
                codes: codes.to_owned(),
                scale: scale.to_owned(),
            },
            Keys::E2m1 { packed, scale } => KData::E2m1 {
                packed: packed.to_owned(),
                scale: scale.to_owned(),
            },
            Keys::Paged(pk) => KData::Paged {
                kv_cache: pk.kv_cache.to_owned(),
                page_table: pk.page_table.to_owned(),
                page_size: pk.page_size,
            },
        };
        Ok(Dump {
            meta: Meta {
                description,
                ..self.meta.clone()
            },
            seq_lens: self.seq_lens.clone(),
            layout: self.layout.clone(),
            q,
            k,
            weights: i.weights.to_owned(),
            k_slots: i.k_slots.map(|s| s.to_owned()),
            candidates: self.candidates.clone(),
            engine_logits,
            expected,
        })
    }
}

/// A layer's tensors on a CUDA device, as the engine entry reads them: the caller's
/// buffers, not copied.
#[cfg(feature = "cuda")]
pub mod device {
    use std::marker::PhantomData;
    use std::mem::ManuallyDrop;
    use std::sync::Arc;

    use cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut, DeviceRepr};
    use dsa_indexer::cuda::{DeviceInputs, DeviceKeys, DeviceQueries};

    use super::*;

    /// A caller's device buffer (a tensor's memory) as a cudarc slice on `stream`, which
    /// never frees it: dropping it leaks the slice, and the tensor it borrows keeps the
    /// memory alive. The context must not track events (the package's contexts do
    /// not), so taking its pointer inserts no event, wait or synchronisation.
    pub struct DevBuf<'t, T> {
        slice: ManuallyDrop<CudaSlice<T>>,
        _tensor: PhantomData<&'t Tensor>,
    }

    impl<T> Drop for DevBuf<'_, T> {
        fn drop(&mut self) {
            // SAFETY: taken once, here; leak() frees nothing.
            let slice = unsafe { ManuallyDrop::take(&mut self.slice) };
            slice.leak();
        }
    }

    impl<'t, T: DeviceRepr> DevBuf<'t, T> {
        /// The memory of `t`, a row-major tensor of `T`-sized elements on CUDA device
        /// `ordinal` (the caller checks the dtype), as `T`s.
        pub fn new(t: &'t Tensor, stream: &Arc<CudaStream>, ordinal: usize) -> Result<Self> {
            let (addr, bytes) = t.device_data(ordinal)?;
            let size = std::mem::size_of::<T>();
            if !addr.is_multiple_of(std::mem::align_of::<T>() as u64) || bytes % size != 0 {
                return Err(bad(
                    t.name,
                    format!("device address {addr:#x} is not aligned to its dtype"),
                ));
            }
            // SAFETY: `t` (which this borrows) keeps `bytes` bytes at `addr` alive on the
            // stream's device; the slice is never freed (Drop leaks it).
            let slice = unsafe { stream.upgrade_device_ptr::<T>(addr, bytes / size) };
            Ok(DevBuf {
                slice: ManuallyDrop::new(slice),
                _tensor: PhantomData,
            })
        }
    }

    impl<T> DevBuf<'_, T> {
        /// The whole buffer.
        pub fn view(&self) -> CudaView<'_, T> {
            self.slice.as_view()
        }

        /// The whole buffer, to write.
        pub fn view_mut(&mut self) -> CudaViewMut<'_, T> {
            self.slice.as_view_mut()
        }

        /// The device address.
        pub fn addr(&self) -> u64 {
            let s = self.slice.stream().clone();
            crate::cuda::addr(&*self.slice, &s)
        }
    }

    /// Bytes of a [`Bytes::View`] on the device; converted ones are an error there.
    fn bytes<'a>(
        name: &str,
        b: &'a Bytes,
        s: &Arc<CudaStream>,
        ordinal: usize,
    ) -> Result<DevBuf<'a, u8>> {
        match b {
            Bytes::View(t) => DevBuf::new(t, s, ordinal),
            Bytes::Owned(_) => Err(bad(
                name,
                "int32 scale words of D < 128 are converted on the host: on CUDA pass UE8M0 \
                 bytes [.., D/32] (uint8 or float8_e8m0fnu)",
            )),
        }
    }

    fn floats<'a>(
        name: &str,
        f: &'a Floats,
        s: &Arc<CudaStream>,
        ordinal: usize,
    ) -> Result<DevBuf<'a, f32>> {
        match f {
            Floats::View(t) => DevBuf::new(t, s, ordinal),
            Floats::Owned(_) => Err(bad(
                name,
                "converted to float32 on the host: on CUDA pass float32",
            )),
        }
    }

    fn ints<'a>(
        name: &str,
        i: &'a Ints,
        s: &Arc<CudaStream>,
        ordinal: usize,
    ) -> Result<DevBuf<'a, i32>> {
        match i {
            Ints::View(t) => DevBuf::new(t, s, ordinal),
            Ints::Owned(_) => Err(bad(
                name,
                "converted to int32 on the host: on CUDA pass int32",
            )),
        }
    }

    enum DevQ<'a> {
        E4m3(DevBuf<'a, u8>),
        E2m1 {
            packed: DevBuf<'a, u8>,
            scale: DevBuf<'a, u8>,
        },
    }

    enum DevK<'a> {
        E4m3 {
            codes: DevBuf<'a, u8>,
            scale: DevBuf<'a, f32>,
        },
        E2m1 {
            packed: DevBuf<'a, u8>,
            scale: DevBuf<'a, u8>,
        },
        Paged {
            format: Format,
            kv_cache: DevBuf<'a, u8>,
            page_table: DevBuf<'a, i32>,
            max_pages: usize,
            page_size: usize,
        },
    }

    /// The queries on the device (`q`, and `q_scale` for packed fp4).
    fn dev_q<'a>(q: &'a Q, s: &Arc<CudaStream>, ordinal: usize) -> Result<DevQ<'a>> {
        Ok(match q {
            Q::E4m3(sh) => DevQ::E4m3(bytes("q", &sh.bytes, s, ordinal)?),
            Q::E2m1 { packed, scale } => DevQ::E2m1 {
                packed: bytes("q", &packed.bytes, s, ordinal)?,
                scale: bytes("q_scale", &scale.bytes, s, ordinal)?,
            },
        })
    }

    fn q_view<'v>(q: &'v DevQ<'_>) -> DeviceQueries<'v> {
        match q {
            DevQ::E4m3(b) => DeviceQueries::E4m3(b.view()),
            DevQ::E2m1 { packed, scale } => DeviceQueries::E2m1 {
                packed: packed.view(),
                scale: scale.view(),
            },
        }
    }

    fn q_addrs(q: &DevQ<'_>, v: &mut Vec<(&'static str, u64)>) {
        match q {
            DevQ::E4m3(b) => v.push(("q", b.addr())),
            DevQ::E2m1 { packed, scale } => {
                v.push(("q", packed.addr()));
                v.push(("q_scale", scale.addr()));
            }
        }
    }

    /// A layer's inputs on the device ([`Layer::on_device`]).
    pub struct DeviceLayer<'a> {
        heads: usize,
        dim: usize,
        q: DevQ<'a>,
        k: DevK<'a>,
        weights: DevBuf<'a, f32>,
        k_slots: Option<DevBuf<'a, i32>>,
        candidates: Option<DevBuf<'a, i32>>,
    }

    impl DeviceLayer<'_> {
        /// The engine's view of the inputs.
        pub fn inputs(&self) -> DeviceInputs<'_> {
            let k = match &self.k {
                DevK::E4m3 { codes, scale } => DeviceKeys::E4m3 {
                    codes: codes.view(),
                    scale: scale.view(),
                },
                DevK::E2m1 { packed, scale } => DeviceKeys::E2m1 {
                    packed: packed.view(),
                    scale: scale.view(),
                },
                DevK::Paged {
                    format,
                    kv_cache,
                    page_table,
                    max_pages,
                    page_size,
                } => DeviceKeys::Paged {
                    format: *format,
                    kv_cache: kv_cache.view(),
                    page_table: page_table.view(),
                    max_pages: *max_pages,
                    page_size: *page_size,
                },
            };
            DeviceInputs {
                heads: self.heads,
                dim: self.dim,
                q: q_view(&self.q),
                k,
                weights: self.weights.view(),
                k_slots: self.k_slots.as_ref().map(|b| b.view()),
            }
        }

        /// A consumer's candidates `[T, NB]`.
        pub fn candidates(&self) -> Option<CudaView<'_, i32>> {
            self.candidates.as_ref().map(|b| b.view())
        }

        /// The device address of every input, by argument name.
        pub fn addrs(&self) -> Vec<(&'static str, u64)> {
            let mut v = Vec::new();
            q_addrs(&self.q, &mut v);
            match &self.k {
                DevK::E4m3 { codes, scale } => {
                    v.push(("k", codes.addr()));
                    v.push(("k_scale", scale.addr()));
                }
                DevK::E2m1 { packed, scale } => {
                    v.push(("k", packed.addr()));
                    v.push(("k_scale", scale.addr()));
                }
                DevK::Paged {
                    kv_cache,
                    page_table,
                    ..
                } => {
                    v.push(("kv_cache", kv_cache.addr()));
                    v.push(("page_table", page_table.addr()));
                }
            }
            v.push(("weights", self.weights.addr()));
            if let Some(b) = &self.k_slots {
                v.push(("k_slots", b.addr()));
            }
            if let Some(b) = &self.candidates {
                v.push(("candidates", b.addr()));
            }
            v
        }
    }

    impl Layer {
        /// The layer's tensors as device buffers on `stream` of CUDA device `ordinal`
        /// (every one must live there), read in place.
        pub fn on_device(&self, s: &Arc<CudaStream>, ordinal: usize) -> Result<DeviceLayer<'_>> {
            let q = dev_q(&self.q, s, ordinal)?;
            let k = match &self.k {
                K::E4m3 { codes, scale, .. } => DevK::E4m3 {
                    codes: bytes("k", &codes.bytes, s, ordinal)?,
                    scale: floats("k_scale", scale, s, ordinal)?,
                },
                K::E2m1 { packed, scale } => DevK::E2m1 {
                    packed: bytes("k", &packed.bytes, s, ordinal)?,
                    scale: bytes("k_scale", &scale.bytes, s, ordinal)?,
                },
                K::Paged {
                    kv_cache,
                    page_table,
                    table_shape,
                    page_size,
                } => DevK::Paged {
                    format: self.meta.k_format,
                    kv_cache: bytes("kv_cache", &kv_cache.bytes, s, ordinal)?,
                    page_table: ints("page_table", page_table, s, ordinal)?,
                    max_pages: table_shape[1],
                    page_size: *page_size,
                },
            };
            let weights = floats("weights", &self.weights, s, ordinal)?;
            let k_slots = match &self.k_slots {
                Some(i) => Some(ints("k_slots", i, s, ordinal)?),
                None => None,
            };
            let candidates = match &self.device_candidates {
                Some(t) => Some(DevBuf::new(t, s, ordinal)?),
                None => None,
            };
            Ok(DeviceLayer {
                heads: self.meta.heads,
                dim: self.meta.dim,
                q,
                k,
                weights,
                k_slots,
                candidates,
            })
        }
    }

    /// A decode step's inputs on the device: queries, weights, the pool and its page
    /// table, as the engines hold them (SPEC 10), checked as [`Layer`] checks them.
    pub struct DecodeLayer {
        q: Q,
        kv_cache: Shaped,
        page_table: Ints,
        /// Query format.
        pub q_format: Format,
        /// Key format (of the pool).
        pub k_format: Format,
        /// `H`.
        pub heads: usize,
        /// `D`.
        pub dim: usize,
        weights: Floats,
        /// `[R, H]`.
        pub weights_shape: [usize; 2],
        /// `page_table`'s `[B, max_pages]`.
        pub table_shape: [usize; 2],
    }

    /// The device buffers of a [`DecodeLayer`].
    pub struct DecodeBufs<'a> {
        q: DevQ<'a>,
        weights: DevBuf<'a, f32>,
        kv_cache: DevBuf<'a, u8>,
        page_table: DevBuf<'a, i32>,
    }

    impl DecodeLayer {
        /// Check `q` (with `q_scale`), `weights`, `kv_cache` and `page_table` of
        /// `page_size` tokens a page.
        pub fn new(
            q: Tensor,
            q_scale: Option<Tensor>,
            weights: Tensor,
            kv_cache: Tensor,
            page_table: Tensor,
            page_size: usize,
        ) -> Result<DecodeLayer> {
            let (q, q_format, heads, dim) = queries(q, q_scale)?;
            let (k, k_format) = paged_keys(kv_cache, page_table, page_size, dim)?;
            let K::Paged {
                kv_cache,
                page_table,
                table_shape,
                ..
            } = k
            else {
                return Err(bad("kv_cache", "not a page pool"));
            };
            if weights.shape.len() != 2 {
                return Err(weights.error("float32 [B * next_n, H]"));
            }
            let weights_shape = [weights.shape[0], weights.shape[1]];
            Ok(DecodeLayer {
                q,
                kv_cache,
                page_table,
                q_format,
                k_format,
                heads,
                dim,
                weights: Floats::of(weights)?,
                weights_shape,
                table_shape,
            })
        }

        /// The buffers on `stream` of CUDA device `ordinal`.
        pub fn on_device(&self, s: &Arc<CudaStream>, ordinal: usize) -> Result<DecodeBufs<'_>> {
            Ok(DecodeBufs {
                q: dev_q(&self.q, s, ordinal)?,
                weights: floats("weights", &self.weights, s, ordinal)?,
                kv_cache: bytes("kv_cache", &self.kv_cache.bytes, s, ordinal)?,
                page_table: ints("page_table", &self.page_table, s, ordinal)?,
            })
        }
    }

    impl DecodeBufs<'_> {
        /// Queries, weights, pool and page table as the decode step takes them (with
        /// the caller's `context_lens`).
        pub fn inputs<'v>(
            &'v self,
            context_lens: CudaView<'v, i32>,
        ) -> dsa_indexer::cuda::DecodeInputs<'v> {
            dsa_indexer::cuda::DecodeInputs {
                q: q_view(&self.q),
                weights: self.weights.view(),
                kv_cache: self.kv_cache.view(),
                page_table: self.page_table.view(),
                context_lens,
            }
        }

        /// The device address of every input, by argument name.
        pub fn addrs(&self) -> Vec<(&'static str, u64)> {
            let mut v = Vec::new();
            q_addrs(&self.q, &mut v);
            v.push(("weights", self.weights.addr()));
            v.push(("kv_cache", self.kv_cache.addr()));
            v.push(("page_table", self.page_table.addr()));
            v
        }
    }
}
