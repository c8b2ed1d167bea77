//! Reading a dump: `safetensors` bytes to a [`Dump`], accepting the dtypes a PyTorch
//! user has. Every problem is an [`Error::Dump`] naming the tensor.

use std::collections::HashMap;

use ndarray::{Array1, Array2, Array3};
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;

use super::derr;
use super::schema::{Dump, Expected, KData, Layout, Meta, QData, RoleKind};
use crate::error::{Error, Result};
use crate::problem::Format;

struct Reader<'a> {
    st: SafeTensors<'a>,
}

impl<'a> Reader<'a> {
    fn get(&self, name: &str) -> Option<TensorView<'a>> {
        self.st.tensor(name).ok()
    }
    fn need(&self, name: &str) -> Result<TensorView<'a>> {
        self.get(name).ok_or_else(|| derr(name, "missing"))
    }
}

fn dtype_err(name: &str, t: &TensorView, want: &str) -> Error {
    derr(name, format!("dtype {:?}, expected {want}", t.dtype()))
}

fn ndim(name: &str, t: &TensorView, n: usize) -> Result<()> {
    if t.shape().len() != n {
        return Err(derr(
            name,
            format!("shape {:?}, expected {n} dimensions", t.shape()),
        ));
    }
    Ok(())
}

fn i32s(name: &str, t: &TensorView) -> Result<Vec<i32>> {
    if t.dtype() != Dtype::I32 {
        return Err(dtype_err(name, t, "I32"));
    }
    Ok(t.data()
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

fn f32s(name: &str, t: &TensorView) -> Result<Vec<f32>> {
    match t.dtype() {
        Dtype::F32 => Ok(t
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()),
        Dtype::BF16 => Ok(t
            .data()
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect()),
        _ => Err(dtype_err(name, t, "F32 or BF16")),
    }
}

fn usizes(name: &str, v: &[i32]) -> Result<Vec<usize>> {
    v.iter()
        .enumerate()
        .map(|(i, &x)| {
            usize::try_from(x).map_err(|_| derr(name, format!("[{i}] = {x}, expected >= 0")))
        })
        .collect()
}

/// A 1-D I32 tensor of non-negative values.
fn usize_vec(name: &str, t: &TensorView) -> Result<Vec<usize>> {
    usizes(name, &i32s(name, t)?)
}

fn arr2<T: Clone>(name: &str, shape: &[usize], v: Vec<T>) -> Result<Array2<T>> {
    Array2::from_shape_vec((shape[0], shape[1]), v).map_err(|e| derr(name, e.to_string()))
}

fn i32_2d(name: &str, t: &TensorView) -> Result<Array2<i32>> {
    ndim(name, t, 2)?;
    arr2(name, t.shape(), i32s(name, t)?)
}

/// Bytes of a byte-typed tensor (`U8`, `I8`, `F8_*`, `F4`).
fn bytes(name: &str, t: &TensorView, ok: &[Dtype], want: &str) -> Result<Vec<u8>> {
    if !ok.contains(&t.dtype()) {
        return Err(dtype_err(name, t, want));
    }
    Ok(t.data().to_vec())
}

/// UE8M0 scale bytes `[.., G]` from `U8`/`F8_E8M0` bytes or `I32` words (byte `g` = group `g`).
fn scale_bytes(name: &str, t: &TensorView, lead: &[usize], groups: usize) -> Result<Vec<u8>> {
    let rows: usize = lead.iter().product();
    match t.dtype() {
        Dtype::U8 | Dtype::F8_E8M0 => {
            let mut want = lead.to_vec();
            want.push(groups);
            if t.shape() != want.as_slice() {
                return Err(derr(
                    name,
                    format!("shape {:?}, expected {want:?}", t.shape()),
                ));
            }
            Ok(t.data().to_vec())
        }
        Dtype::I32 => {
            let want = lead.to_vec();
            let want1 = [lead, &[1]].concat();
            if t.shape() != want.as_slice() && t.shape() != want1.as_slice() {
                return Err(derr(
                    name,
                    format!("shape {:?}, expected {want:?} packed I32 words", t.shape()),
                ));
            }
            let d = t.data();
            Ok((0..rows)
                .flat_map(|r| d[r * 4..r * 4 + groups].to_vec())
                .collect())
        }
        _ => Err(dtype_err(name, t, "U8, F8_E8M0 or I32")),
    }
}

/// When a file's header parses but its data section is shorter than the header says,
/// the error naming the first tensor whose bytes are missing.
fn truncated(buf: &[u8]) -> Option<Error> {
    let n = u64::from_le_bytes(buf.get(..8)?.try_into().ok()?);
    let n = usize::try_from(n).ok()?;
    let header = buf.get(8..8usize.checked_add(n)?)?;
    let v: serde_json::Value = serde_json::from_slice(header).ok()?;
    let have = buf.len() - 8 - n;
    let mut ts: Vec<(u64, u64, &String)> = v
        .as_object()?
        .iter()
        .filter(|(k, _)| k.as_str() != "__metadata__")
        .filter_map(|(k, t)| {
            let o = t.get("data_offsets")?.as_array()?;
            Some((o.first()?.as_u64()?, o.get(1)?.as_u64()?, k))
        })
        .collect();
    ts.sort();
    let (a, b, name) = ts.into_iter().find(|&(_, b, _)| b > have as u64)?;
    Some(derr(
        name,
        format!(
            "truncated: its bytes are [{a}, {b}) of the data section, the file has {have} (file length {})",
            buf.len()
        ),
    ))
}

/// When a file's header does not validate because a tensor's bytes do not fit its dtype
/// and shape (an `F4` shape counted in packed bytes, a `BF16` tensor of the wrong
/// length), the error naming the first such tensor.
fn mis_sized(buf: &[u8]) -> Option<Error> {
    let n = u64::from_le_bytes(buf.get(..8)?.try_into().ok()?);
    let n = usize::try_from(n).ok()?;
    let header = buf.get(8..8usize.checked_add(n)?)?;
    let v: serde_json::Value = serde_json::from_slice(header).ok()?;
    let mut ts: Vec<(u64, u64, &String, &serde_json::Value)> = v
        .as_object()?
        .iter()
        .filter(|(k, _)| k.as_str() != "__metadata__")
        .filter_map(|(k, t)| {
            let o = t.get("data_offsets")?.as_array()?;
            Some((o.first()?.as_u64()?, o.get(1)?.as_u64()?, k, t))
        })
        .collect();
    ts.sort_by_key(|t| (t.0, t.1));
    ts.into_iter().find_map(|(a, b, name, t)| {
        let dtype: Dtype = serde_json::from_value(t.get("dtype")?.clone()).ok()?;
        let shape: Vec<u64> = serde_json::from_value(t.get("shape")?.clone()).ok()?;
        let elems = shape.iter().try_fold(1u64, |x, &y| x.checked_mul(y))?;
        let bits = elems.checked_mul(dtype.bitsize() as u64)?;
        let have = b.checked_sub(a)?;
        if bits % 8 == 0 && bits / 8 == have {
            return None;
        }
        let hint = if dtype == Dtype::F4 {
            " (an F4 shape counts fp4 elements, two a byte: [.., D], not [.., D/2])"
        } else {
            ""
        };
        Some(derr(
            name,
            format!(
                "dtype {dtype}, shape {shape:?}: {elems} elements of {} bits are {bits} bits, its data_offsets hold {have} bytes{hint}",
                dtype.bitsize()
            ),
        ))
    })
}

/// `H` and `D` of the metadata: the values the schema allows.
fn check_heads_dim(meta: &Meta) -> Result<()> {
    let (h, d) = (meta.heads, meta.dim);
    if !(h.is_power_of_two() && (8..=64).contains(&h)) {
        return Err(derr(
            "__metadata__",
            format!("heads = {h}, expected a power of two in 8..=64"),
        ));
    }
    if ![32, 64, 128].contains(&d) {
        return Err(derr(
            "__metadata__",
            format!("dim = {d}, expected 32, 64 or 128"),
        ));
    }
    Ok(())
}

impl Reader<'_> {
    /// `query_starts`, or `row_requests` with `row_positions`.
    fn layout(&self) -> Result<Layout> {
        match (
            self.get("query_starts"),
            self.get("row_requests"),
            self.get("row_positions"),
        ) {
            (Some(qs), None, None) => {
                ndim("query_starts", &qs, 1)?;
                Ok(Layout::Contiguous(usize_vec("query_starts", &qs)?))
            }
            (None, Some(rr), Some(rp)) => Ok(Layout::Explicit {
                requests: usize_vec("row_requests", &rr)?,
                positions: usize_vec("row_positions", &rp)?,
            }),
            _ => Err(derr(
                "query_starts",
                "expected either query_starts, or both row_requests and row_positions",
            )),
        }
    }

    /// `q` (and `q_scale` for E2M1 queries).
    fn queries(&self, meta: &Meta) -> Result<QData> {
        let (h, d, g) = (meta.heads, meta.dim, meta.dim / 32);
        let qt = self.need("q")?;
        ndim("q", &qt, 3)?;
        let (t, qh) = (qt.shape()[0], qt.shape()[1]);
        if qh != h {
            return Err(derr(
                "q",
                format!(
                    "shape {:?}, expected [T, {h}, ..] (heads = {h})",
                    qt.shape()
                ),
            ));
        }
        match meta.q_format {
            Format::E4m3 => {
                if qt.shape()[2] != d {
                    return Err(derr(
                        "q",
                        format!("shape {:?}, expected [{t}, {h}, {d}]", qt.shape()),
                    ));
                }
                let codes = bytes("q", &qt, &[Dtype::U8, Dtype::F8_E4M3], "U8 or F8_E4M3")?;
                Ok(QData::E4m3(
                    Array3::from_shape_vec((t, h, d), codes)
                        .map_err(|e| derr("q", e.to_string()))?,
                ))
            }
            Format::E2m1 => {
                let want = if qt.dtype() == Dtype::F4 { d } else { d / 2 };
                if qt.shape()[2] != want {
                    return Err(derr(
                        "q",
                        format!("shape {:?}, expected [{t}, {h}, {want}]", qt.shape()),
                    ));
                }
                let packed = bytes(
                    "q",
                    &qt,
                    &[Dtype::U8, Dtype::I8, Dtype::F4],
                    "U8, I8 or F4 packed fp4",
                )?;
                let packed = Array3::from_shape_vec((t, h, d / 2), packed)
                    .map_err(|e| derr("q", e.to_string()))?;
                let qs = self.need("q_scale")?;
                let scale = scale_bytes("q_scale", &qs, &[t, h], g)?;
                Ok(QData::E2m1 {
                    packed,
                    scale: Array3::from_shape_vec((t, h, g), scale)
                        .map_err(|e| derr("q_scale", e.to_string()))?,
                })
            }
        }
    }

    /// `kv_cache`, `page_table` and the metadata `page_size` (SPEC 10): the pool's
    /// shape and the table's are checked when the problem is built.
    fn paged_keys(&self, page_size: Option<usize>) -> Result<KData> {
        for flat in ["k", "k_scale", "k_slots"] {
            if self.get(flat).is_some() {
                return Err(derr(
                    flat,
                    "present beside kv_cache: a dump holds flat or paged keys, not both",
                ));
            }
        }
        let page_size =
            page_size.ok_or_else(|| derr("__metadata__", "page_size missing (kv_cache given)"))?;
        let kv = self.need("kv_cache")?;
        ndim("kv_cache", &kv, 2)?;
        let kv_cache = arr2(
            "kv_cache",
            kv.shape(),
            bytes("kv_cache", &kv, &[Dtype::U8, Dtype::I8], "U8 or I8 bytes")?,
        )?;
        let pt = self.need("page_table")?;
        Ok(KData::Paged {
            kv_cache,
            page_table: i32_2d("page_table", &pt)?,
            page_size,
        })
    }

    /// `k` and `k_scale`.
    fn keys(&self, meta: &Meta) -> Result<KData> {
        let (d, g) = (meta.dim, meta.dim / 32);
        let kt = self.need("k")?;
        ndim("k", &kt, 2)?;
        let l = kt.shape()[0];
        match meta.k_format {
            Format::E4m3 => {
                if kt.shape()[1] != d {
                    return Err(derr(
                        "k",
                        format!("shape {:?}, expected [{l}, {d}]", kt.shape()),
                    ));
                }
                let codes = arr2(
                    "k",
                    kt.shape(),
                    bytes("k", &kt, &[Dtype::U8, Dtype::F8_E4M3], "U8 or F8_E4M3")?,
                )?;
                let ks = self.need("k_scale")?;
                if ks.dtype() != Dtype::F32 {
                    return Err(dtype_err("k_scale", &ks, "F32"));
                }
                if ks.shape() != [l] && ks.shape() != [l, 1] {
                    return Err(derr(
                        "k_scale",
                        format!("shape {:?}, expected [{l}]", ks.shape()),
                    ));
                }
                Ok(KData::E4m3 {
                    codes,
                    scale: Array1::from(f32s("k_scale", &ks)?),
                })
            }
            Format::E2m1 => {
                let want = if kt.dtype() == Dtype::F4 { d } else { d / 2 };
                if kt.shape()[1] != want {
                    return Err(derr(
                        "k",
                        format!("shape {:?}, expected [{l}, {want}]", kt.shape()),
                    ));
                }
                let packed = bytes(
                    "k",
                    &kt,
                    &[Dtype::U8, Dtype::I8, Dtype::F4],
                    "U8, I8 or F4 packed fp4",
                )?;
                let packed = Array2::from_shape_vec((l, d / 2), packed)
                    .map_err(|e| derr("k", e.to_string()))?;
                let ks = self.need("k_scale")?;
                let scale = scale_bytes("k_scale", &ks, &[l], g)?;
                Ok(KData::E2m1 {
                    packed,
                    scale: Array2::from_shape_vec((l, g), scale)
                        .map_err(|e| derr("k_scale", e.to_string()))?,
                })
            }
        }
    }

    /// An optional 1-D I32 tensor.
    fn vec_i32(&self, name: &str) -> Result<Option<Vec<i32>>> {
        self.get(name)
            .map(|t| ndim(name, &t, 1).and_then(|_| i32s(name, &t)))
            .transpose()
    }

    /// An optional 2-D I32 tensor.
    fn opt_i32_2d(&self, name: &str) -> Result<Option<Array2<i32>>> {
        self.get(name).map(|t| i32_2d(name, &t)).transpose()
    }

    /// The `expected_*` tensors.
    fn expected(&self) -> Result<Expected> {
        Ok(Expected {
            ks: self.vec_i32("expected_ks")?,
            ke: self.vec_i32("expected_ke")?,
            logits: self
                .get("expected_logits")
                .map(|t| f32s("expected_logits", &t))
                .transpose()?,
            raw: self.opt_i32_2d("expected_raw")?,
            page: self.opt_i32_2d("expected_page")?,
            published: self.opt_i32_2d("expected_published")?,
            published_rows: self.vec_i32("expected_published_rows")?,
        })
    }
}

impl Dump {
    /// Parse a dump. Any problem is an [`Error::Dump`] naming the tensor.
    pub fn from_bytes(buf: &[u8]) -> Result<Dump> {
        let (_, header) = SafeTensors::read_metadata(buf).map_err(|e| {
            truncated(buf)
                .or_else(|| mis_sized(buf))
                .unwrap_or_else(|| derr("header", e.to_string()))
        })?;
        let st = SafeTensors::deserialize(buf).map_err(|e| derr("header", e.to_string()))?;
        let empty = HashMap::new();
        let meta = Meta::parse(header.metadata().as_ref().unwrap_or(&empty))?;
        let r = Reader { st };
        check_heads_dim(&meta)?;

        let sl = r.need("seq_lens")?;
        ndim("seq_lens", &sl, 1)?;
        let seq_lens = usize_vec("seq_lens", &sl)?;
        let layout = r.layout()?;
        let q = r.queries(&meta)?;
        let k = if r.get("kv_cache").is_some() {
            r.paged_keys(super::schema::meta_num(
                header.metadata().as_ref().unwrap_or(&empty),
                "page_size",
            )?)?
        } else {
            r.keys(&meta)?
        };
        if let (Some(n), Layout::Contiguous(q0)) = (meta.next_n, &layout) {
            // q0_b = S_b - next_n (or 0 for a request shorter than next_n).
            if let Some((b, _)) = seq_lens
                .iter()
                .zip(q0)
                .enumerate()
                .find(|(_, (&s, &q))| q != s.saturating_sub(n))
            {
                return Err(derr(
                    "query_starts",
                    format!(
                        "query_starts[{b}] = {}, but next_n = {n} gives seq_lens[{b}] - {n} = {}",
                        q0[b],
                        seq_lens[b].saturating_sub(n)
                    ),
                ));
            }
        }

        let wt = r.need("weights")?;
        ndim("weights", &wt, 2)?;
        let weights = arr2("weights", wt.shape(), f32s("weights", &wt)?)?;
        let k_slots = match r.get("k_slots") {
            Some(s) => {
                ndim("k_slots", &s, 1)?;
                Some(Array1::from(i32s("k_slots", &s)?))
            }
            None => None,
        };
        let candidates = r.opt_i32_2d("candidates")?;
        if meta.role == RoleKind::Consumer && candidates.is_none() {
            return Err(derr("candidates", "missing (role = consumer)"));
        }
        let engine_logits = match r.get("engine_logits") {
            Some(e) => {
                ndim("engine_logits", &e, 2)?;
                Some(arr2(
                    "engine_logits",
                    e.shape(),
                    f32s("engine_logits", &e)?,
                )?)
            }
            None => None,
        };
        let expected = r.expected()?;
        Ok(Dump {
            meta,
            seq_lens,
            layout,
            q,
            k,
            weights,
            k_slots,
            candidates,
            engine_logits,
            expected,
        })
    }
}
