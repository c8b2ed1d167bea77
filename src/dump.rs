//! Layer-forward dumps (SPEC 9): the golden schema of `golden/README.md`, read and
//! written with the `safetensors` crate. Accepts the dtypes a PyTorch user has.

use std::collections::HashMap;

use ndarray::{Array1, Array2, Array3, Axis};
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;

use crate::batch::Batch;
use crate::error::{Error, Result};
use crate::problem::{Format, Inputs, Keys, Params, Problem, Published, Queries, Role};

/// Which role the dumped layer played.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RoleKind {
    /// Top-k only.
    Plain,
    /// Publishes candidate blocks.
    Source,
    /// Restricted to given candidate blocks.
    Consumer,
}

/// Scalar metadata of a dump (`__metadata__`).
#[derive(Debug, Clone, PartialEq)]
pub struct Meta {
    /// `H`.
    pub heads: usize,
    /// `D`.
    pub dim: usize,
    /// `K`.
    pub topk: usize,
    /// `r`.
    pub ratio: usize,
    /// Query format.
    pub q_format: Format,
    /// Key format.
    pub k_format: Format,
    /// Role.
    pub role: RoleKind,
    /// `B`.
    pub block_size: usize,
    /// `NB`.
    pub num_blocks: usize,
    /// Width of `page`.
    pub page_cols: Option<usize>,
    /// Tail-only publishing.
    pub tail: Option<usize>,
    /// Free text.
    pub description: String,
}

/// Query tensors, owned.
#[derive(Debug, Clone, PartialEq)]
pub enum QData {
    /// E4M3 `[T, H, D]`.
    E4m3(Array3<u8>),
    /// Packed E2M1 `[T, H, D/2]`, UE8M0 `[T, H, D/32]`.
    E2m1 {
        /// Packed codes.
        packed: Array3<u8>,
        /// Scale bytes.
        scale: Array3<u8>,
    },
}

/// Key tensors, owned.
#[derive(Debug, Clone, PartialEq)]
pub enum KData {
    /// E4M3 `[L, D]`, f32 scale `[L]`.
    E4m3 {
        /// Codes.
        codes: Array2<u8>,
        /// Per-key scale.
        scale: Array1<f32>,
    },
    /// Packed E2M1 `[L, D/2]`, UE8M0 `[L, D/32]`.
    E2m1 {
        /// Packed codes.
        packed: Array2<u8>,
        /// Scale bytes.
        scale: Array2<u8>,
    },
}

/// How rows are given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Layout {
    /// `query_starts [B]`.
    Contiguous(Vec<usize>),
    /// `row_requests [T]`, `row_positions [T]`.
    Explicit {
        /// Request of each row.
        requests: Vec<usize>,
        /// Position of each row.
        positions: Vec<usize>,
    },
}

/// Expected (or engine-produced) outputs carried by a dump.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Expected {
    /// `ks [T]`.
    pub ks: Option<Vec<i32>>,
    /// `ke [T]`.
    pub ke: Option<Vec<i32>>,
    /// Visible logits, rows concatenated `[sum n]`.
    pub logits: Option<Vec<f32>>,
    /// `raw [T, K]`.
    pub raw: Option<Array2<i32>>,
    /// `page [T, page_cols]`.
    pub page: Option<Array2<i32>>,
    /// `published [P, NB]`.
    pub published: Option<Array2<i32>>,
    /// `published_rows [P]`.
    pub published_rows: Option<Vec<i32>>,
}

/// One layer-forward, owned.
#[derive(Debug, Clone, PartialEq)]
pub struct Dump {
    /// Scalars.
    pub meta: Meta,
    /// `S_b`.
    pub seq_lens: Vec<usize>,
    /// Rows.
    pub layout: Layout,
    /// Queries.
    pub q: QData,
    /// Keys.
    pub k: KData,
    /// `w [T, H]`.
    pub weights: Array2<f32>,
    /// `k_slots [L]`.
    pub k_slots: Option<Array1<i32>>,
    /// Consumer input `[T, NB]`.
    pub candidates: Option<Array2<i32>>,
    /// The engine's own logits over the flat key buffer, `[T, L]`; only `[ks, ke)` is meaningful.
    pub engine_logits: Option<Array2<f32>>,
    /// Expected outputs.
    pub expected: Expected,
}

fn derr(tensor: &str, problem: impl Into<String>) -> Error {
    Error::Dump {
        tensor: tensor.into(),
        problem: problem.into(),
    }
}

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

fn meta_num(m: &HashMap<String, String>, key: &str) -> Result<Option<usize>> {
    match m.get(key) {
        None => Ok(None),
        Some(s) => s.trim().parse::<usize>().map(Some).map_err(|_| {
            derr(
                "__metadata__",
                format!("{key} = {s:?}, expected a non-negative integer"),
            )
        }),
    }
}

fn meta_req(m: &HashMap<String, String>, key: &str) -> Result<usize> {
    meta_num(m, key)?.ok_or_else(|| derr("__metadata__", format!("{key} missing")))
}

fn format_of(m: &HashMap<String, String>, key: &str) -> Result<Format> {
    match m.get(key).map(|s| s.as_str()) {
        Some("e4m3") => Ok(Format::E4m3),
        Some("e2m1") => Ok(Format::E2m1),
        other => Err(derr(
            "__metadata__",
            format!("{key} = {other:?}, expected \"e4m3\" or \"e2m1\""),
        )),
    }
}

impl Meta {
    fn parse(m: &HashMap<String, String>) -> Result<Meta> {
        let role = match m.get("role").map(|s| s.as_str()) {
            None | Some("plain") => RoleKind::Plain,
            Some("source") => RoleKind::Source,
            Some("consumer") => RoleKind::Consumer,
            Some(o) => {
                return Err(derr(
                    "__metadata__",
                    format!("role = {o:?}, expected plain, source or consumer"),
                ))
            }
        };
        Ok(Meta {
            heads: meta_req(m, "heads")?,
            dim: meta_req(m, "dim")?,
            topk: meta_req(m, "topk")?,
            ratio: meta_req(m, "ratio")?,
            q_format: format_of(m, "q_format")?,
            k_format: format_of(m, "k_format")?,
            role,
            block_size: meta_num(m, "block_size")?.unwrap_or(8),
            num_blocks: meta_num(m, "num_blocks")?.unwrap_or(2048),
            page_cols: meta_num(m, "page_cols")?,
            tail: meta_num(m, "tail")?,
            description: m.get("description").cloned().unwrap_or_default(),
        })
    }

    fn to_map(&self) -> HashMap<String, String> {
        let mut m = HashMap::new();
        let mut put = |k: &str, v: String| {
            m.insert(k.to_string(), v);
        };
        put("heads", self.heads.to_string());
        put("dim", self.dim.to_string());
        put("topk", self.topk.to_string());
        put("ratio", self.ratio.to_string());
        put("q_format", self.q_format.to_string());
        put("k_format", self.k_format.to_string());
        put(
            "cls",
            if (self.q_format, self.k_format) == (Format::E2m1, Format::E2m1) {
                "exact"
            } else {
                "tolerance"
            }
            .into(),
        );
        put(
            "role",
            match self.role {
                RoleKind::Plain => "plain",
                RoleKind::Source => "source",
                RoleKind::Consumer => "consumer",
            }
            .into(),
        );
        put("block_size", self.block_size.to_string());
        put("num_blocks", self.num_blocks.to_string());
        if let Some(c) = self.page_cols {
            put("page_cols", c.to_string());
        }
        if let Some(t) = self.tail {
            put("tail", t.to_string());
        }
        put("description", self.description.clone());
        m
    }
}

/// The same file with its JSON header's keys sorted (metadata included), so that equal
/// dumps are equal bytes: `safetensors` writes the metadata map in hash order. The
/// header stays padded with spaces to a multiple of 8 bytes; data offsets are relative
/// to the data section and do not move.
fn canonical_header(bytes: Vec<u8>) -> Result<Vec<u8>> {
    let bad = |what: &str| derr("header", format!("re-serializing: {what}"));
    let n = u64::from_le_bytes(bytes[..8].try_into().map_err(|_| bad("short file"))?) as usize;
    let header = bytes.get(8..8 + n).ok_or_else(|| bad("short header"))?;
    // serde_json's map is ordered by key.
    let v: serde_json::Value = serde_json::from_slice(header).map_err(|e| bad(&e.to_string()))?;
    let mut h = serde_json::to_vec(&v).map_err(|e| bad(&e.to_string()))?;
    while h.len() % 8 != 0 {
        h.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + h.len() + bytes.len() - 8 - n);
    out.extend_from_slice(&(h.len() as u64).to_le_bytes());
    out.extend_from_slice(&h);
    out.extend_from_slice(&bytes[8 + n..]);
    Ok(out)
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

/// The visible logits of rows `sel`, from all rows' `flat` (`[sum n]`).
fn select_logits(batch: &Batch, flat: Option<&[f32]>, sel: &[usize]) -> Result<Option<Vec<f32>>> {
    let Some(l) = flat else {
        return Ok(None);
    };
    let mut off = Vec::with_capacity(batch.num_rows() + 1);
    off.push(0usize);
    for r in batch.rows() {
        off.push(off[off.len() - 1] + r.n);
    }
    let total = off[off.len() - 1];
    if l.len() != total {
        return Err(derr(
            "expected_logits",
            format!("{} values, expected sum n = {total}", l.len()),
        ));
    }
    Ok(Some(
        sel.iter()
            .flat_map(|&i| l[off[i]..off[i + 1]].iter().copied())
            .collect(),
    ))
}

impl Dump {
    /// Parse a dump. Any problem is an [`Error::Dump`] naming the tensor.
    pub fn from_bytes(buf: &[u8]) -> Result<Dump> {
        let (_, header) = SafeTensors::read_metadata(buf).map_err(|e| match truncated(buf) {
            Some(err) => err,
            None => derr("header", e.to_string()),
        })?;
        let st = SafeTensors::deserialize(buf).map_err(|e| derr("header", e.to_string()))?;
        let empty = HashMap::new();
        let meta = Meta::parse(header.metadata().as_ref().unwrap_or(&empty))?;
        let r = Reader { st };
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
        let g = d / 32;

        let sl = r.need("seq_lens")?;
        ndim("seq_lens", &sl, 1)?;
        let seq_lens = usizes("seq_lens", &i32s("seq_lens", &sl)?)?;
        let layout = match (
            r.get("query_starts"),
            r.get("row_requests"),
            r.get("row_positions"),
        ) {
            (Some(qs), None, None) => {
                ndim("query_starts", &qs, 1)?;
                Layout::Contiguous(usizes("query_starts", &i32s("query_starts", &qs)?)?)
            }
            (None, Some(rr), Some(rp)) => Layout::Explicit {
                requests: usizes("row_requests", &i32s("row_requests", &rr)?)?,
                positions: usizes("row_positions", &i32s("row_positions", &rp)?)?,
            },
            _ => {
                return Err(derr(
                    "query_starts",
                    "expected either query_starts, or both row_requests and row_positions",
                ))
            }
        };

        let qt = r.need("q")?;
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
        let q = match meta.q_format {
            Format::E4m3 => {
                if qt.shape()[2] != d {
                    return Err(derr(
                        "q",
                        format!("shape {:?}, expected [{t}, {h}, {d}]", qt.shape()),
                    ));
                }
                QData::E4m3(
                    Array3::from_shape_vec(
                        (t, h, d),
                        bytes("q", &qt, &[Dtype::U8, Dtype::F8_E4M3], "U8 or F8_E4M3")?,
                    )
                    .map_err(|e| derr("q", e.to_string()))?,
                )
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
                let qs = r.need("q_scale")?;
                let scale = scale_bytes("q_scale", &qs, &[t, h], g)?;
                QData::E2m1 {
                    packed,
                    scale: Array3::from_shape_vec((t, h, g), scale)
                        .map_err(|e| derr("q_scale", e.to_string()))?,
                }
            }
        };

        let kt = r.need("k")?;
        ndim("k", &kt, 2)?;
        let l = kt.shape()[0];
        let k = match meta.k_format {
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
                let ks = r.need("k_scale")?;
                if ks.dtype() != Dtype::F32 {
                    return Err(dtype_err("k_scale", &ks, "F32"));
                }
                if ks.shape() != [l] && ks.shape() != [l, 1] {
                    return Err(derr(
                        "k_scale",
                        format!("shape {:?}, expected [{l}]", ks.shape()),
                    ));
                }
                KData::E4m3 {
                    codes,
                    scale: Array1::from(f32s("k_scale", &ks)?),
                }
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
                let ks = r.need("k_scale")?;
                let scale = scale_bytes("k_scale", &ks, &[l], g)?;
                KData::E2m1 {
                    packed,
                    scale: Array2::from_shape_vec((l, g), scale)
                        .map_err(|e| derr("k_scale", e.to_string()))?,
                }
            }
        };

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
        let candidates = r
            .get("candidates")
            .map(|c| i32_2d("candidates", &c))
            .transpose()?;
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
        let vec_i32 = |name: &str| -> Result<Option<Vec<i32>>> {
            r.get(name)
                .map(|t| ndim(name, &t, 1).and_then(|_| i32s(name, &t)))
                .transpose()
        };
        let expected = Expected {
            ks: vec_i32("expected_ks")?,
            ke: vec_i32("expected_ke")?,
            logits: r
                .get("expected_logits")
                .map(|t| f32s("expected_logits", &t))
                .transpose()?,
            raw: r
                .get("expected_raw")
                .map(|t| i32_2d("expected_raw", &t))
                .transpose()?,
            page: r
                .get("expected_page")
                .map(|t| i32_2d("expected_page", &t))
                .transpose()?,
            published: r
                .get("expected_published")
                .map(|t| i32_2d("expected_published", &t))
                .transpose()?,
            published_rows: vec_i32("expected_published_rows")?,
        };
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

    /// The batch of the dump.
    pub fn batch(&self) -> Result<Batch> {
        match &self.layout {
            Layout::Contiguous(q0) => {
                // Rows are materialised: check the count against `q` first, so that a
                // small file with a huge `seq_lens` is an error, not a huge allocation.
                let t = match &self.q {
                    QData::E4m3(q) => q.shape()[0],
                    QData::E2m1 { packed, .. } => packed.shape()[0],
                };
                let rows = self
                    .seq_lens
                    .iter()
                    .zip(q0)
                    .try_fold(0usize, |a, (&s, &q)| a.checked_add(s.saturating_sub(q)));
                if rows != Some(t) {
                    return Err(derr(
                        "query_starts",
                        format!(
                            "seq_lens - query_starts sum to {} rows, q has {t}",
                            rows.map_or("more than usize::MAX".into(), |r| r.to_string())
                        ),
                    ));
                }
                Batch::contiguous(&self.seq_lens, q0, self.meta.ratio)
            }
            Layout::Explicit {
                requests,
                positions,
            } => Batch::explicit(&self.seq_lens, requests, positions, self.meta.ratio),
        }
    }

    /// A consumer's candidates for `batch`, row `i` for row `i`.
    pub fn published_input(&self, batch: &Batch) -> Option<Published> {
        self.candidates
            .as_ref()
            .map(|c| Published::for_batch(batch, self.meta.block_size, c.clone()))
    }

    /// Layer parameters.
    pub fn params(&self) -> Params {
        Params {
            topk: self.meta.topk,
            page_cols: self.meta.page_cols,
            block_size: self.meta.block_size,
            num_blocks: self.meta.num_blocks,
        }
    }

    /// Views of the inputs.
    pub fn inputs(&self) -> Inputs<'_> {
        Inputs {
            q: match &self.q {
                QData::E4m3(q) => Queries::E4m3(q.view()),
                QData::E2m1 { packed, scale } => Queries::E2m1 {
                    packed: packed.view(),
                    scale: scale.view(),
                },
            },
            k: match &self.k {
                KData::E4m3 { codes, scale } => Keys::E4m3 {
                    codes: codes.view(),
                    scale: scale.view(),
                },
                KData::E2m1 { packed, scale } => Keys::E2m1 {
                    packed: packed.view(),
                    scale: scale.view(),
                },
            },
            weights: self.weights.view(),
            k_slots: self.k_slots.as_ref().map(|s| s.view()),
        }
    }

    /// The validated problem (`published` from [`Dump::published_input`] for consumers).
    pub fn problem<'a>(
        &'a self,
        batch: &'a Batch,
        published: Option<&'a Published>,
    ) -> Result<Problem<'a>> {
        let role = match (self.meta.role, published) {
            (RoleKind::Plain, _) => Role::Plain,
            (RoleKind::Source, _) => Role::Source {
                tail: self.meta.tail,
            },
            (RoleKind::Consumer, Some(p)) => Role::Consumer(p),
            (RoleKind::Consumer, None) => {
                return Err(derr("candidates", "missing (role = consumer)"))
            }
        };
        let p = Problem::new(batch, self.inputs(), self.params(), role)?;
        if p.heads != self.meta.heads || p.dim != self.meta.dim {
            return Err(derr(
                "q",
                format!("H = {}, D = {} disagree with the metadata", p.heads, p.dim),
            ));
        }
        Ok(p)
    }

    /// The dump restricted to rows `sel` of `batch` (the dump's batch), in that order:
    /// an explicit layout, and every per-row tensor (expected ones included) cut to
    /// those rows. Published rows keep those among `sel`, renumbered.
    pub fn select_rows(&self, batch: &Batch, sel: &[usize]) -> Result<Dump> {
        let t = batch.num_rows();
        if let Some(&i) = sel.iter().find(|&&i| i >= t) {
            return Err(Error::range("rows", i, "rows of the dump"));
        }
        let rows_of = |name: &str, shape: &[usize]| -> Result<()> {
            if shape.first() != Some(&t) {
                return Err(derr(name, format!("shape {shape:?}, expected {t} rows")));
            }
            Ok(())
        };
        let rows3 = |name: &str, a: &Array3<u8>| -> Result<Array3<u8>> {
            rows_of(name, a.shape())?;
            Ok(a.select(Axis(0), sel))
        };
        let rows2 = |name: &str, a: &Option<Array2<i32>>| -> Result<Option<Array2<i32>>> {
            a.as_ref()
                .map(|a| rows_of(name, a.shape()).map(|_| a.select(Axis(0), sel)))
                .transpose()
        };
        let pick = |name: &str, v: &Option<Vec<i32>>| -> Result<Option<Vec<i32>>> {
            v.as_ref()
                .map(|v| rows_of(name, &[v.len()]).map(|_| sel.iter().map(|&i| v[i]).collect()))
                .transpose()
        };
        let q = match &self.q {
            QData::E4m3(q) => QData::E4m3(rows3("q", q)?),
            QData::E2m1 { packed, scale } => QData::E2m1 {
                packed: rows3("q", packed)?,
                scale: rows3("q_scale", scale)?,
            },
        };
        rows_of("weights", self.weights.shape())?;
        let e = &self.expected;
        let (published, published_rows) = match (&e.published, &e.published_rows) {
            (Some(pb), Some(pr)) => {
                let pos: HashMap<usize, usize> = sel
                    .iter()
                    .enumerate()
                    .map(|(new, &old)| (old, new))
                    .collect();
                let keep: Vec<(usize, i32)> = pr
                    .iter()
                    .enumerate()
                    .filter_map(|(k, &r)| {
                        let new = pos.get(&usize::try_from(r).ok()?)?;
                        Some((k, *new as i32))
                    })
                    .collect();
                if let Some(&(k, _)) = keep.iter().find(|x| x.0 >= pb.nrows()) {
                    return Err(derr(
                        "expected_published_rows",
                        format!("entry {k}: expected_published has {} rows", pb.nrows()),
                    ));
                }
                (
                    Some(pb.select(Axis(0), &keep.iter().map(|x| x.0).collect::<Vec<_>>())),
                    Some(keep.iter().map(|x| x.1).collect()),
                )
            }
            _ => (None, None),
        };
        Ok(Dump {
            meta: self.meta.clone(),
            seq_lens: self.seq_lens.clone(),
            layout: Layout::Explicit {
                requests: sel.iter().map(|&i| batch.rows()[i].request).collect(),
                positions: sel.iter().map(|&i| batch.rows()[i].position).collect(),
            },
            q,
            k: self.k.clone(),
            weights: self.weights.select(Axis(0), sel),
            k_slots: self.k_slots.clone(),
            candidates: rows2("candidates", &self.candidates)?,
            engine_logits: match &self.engine_logits {
                Some(a) => {
                    rows_of("engine_logits", a.shape())?;
                    Some(a.select(Axis(0), sel))
                }
                None => None,
            },
            expected: Expected {
                ks: pick("expected_ks", &e.ks)?,
                ke: pick("expected_ke", &e.ke)?,
                logits: select_logits(batch, e.logits.as_deref(), sel)?,
                raw: rows2("expected_raw", &e.raw)?,
                page: rows2("expected_page", &e.page)?,
                published,
                published_rows,
            },
        })
    }

    /// Serialise to safetensors bytes.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let mut t: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
        let i32b = |v: &[i32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let f32b = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let us = |v: &[usize]| {
            v.iter()
                .map(|&x| i32::try_from(x).unwrap_or(-1))
                .collect::<Vec<i32>>()
        };
        t.push((
            "seq_lens".into(),
            Dtype::I32,
            vec![self.seq_lens.len()],
            i32b(&us(&self.seq_lens)),
        ));
        match &self.layout {
            Layout::Contiguous(q0) => t.push((
                "query_starts".into(),
                Dtype::I32,
                vec![q0.len()],
                i32b(&us(q0)),
            )),
            Layout::Explicit {
                requests,
                positions,
            } => {
                t.push((
                    "row_requests".into(),
                    Dtype::I32,
                    vec![requests.len()],
                    i32b(&us(requests)),
                ));
                t.push((
                    "row_positions".into(),
                    Dtype::I32,
                    vec![positions.len()],
                    i32b(&us(positions)),
                ));
            }
        }
        match &self.q {
            QData::E4m3(q) => t.push((
                "q".into(),
                Dtype::U8,
                q.shape().to_vec(),
                q.iter().copied().collect(),
            )),
            QData::E2m1 { packed, scale } => {
                t.push((
                    "q".into(),
                    Dtype::U8,
                    packed.shape().to_vec(),
                    packed.iter().copied().collect(),
                ));
                t.push((
                    "q_scale".into(),
                    Dtype::U8,
                    scale.shape().to_vec(),
                    scale.iter().copied().collect(),
                ));
            }
        }
        match &self.k {
            KData::E4m3 { codes, scale } => {
                t.push((
                    "k".into(),
                    Dtype::U8,
                    codes.shape().to_vec(),
                    codes.iter().copied().collect(),
                ));
                t.push((
                    "k_scale".into(),
                    Dtype::F32,
                    vec![scale.len()],
                    f32b(&scale.to_vec()),
                ));
            }
            KData::E2m1 { packed, scale } => {
                t.push((
                    "k".into(),
                    Dtype::U8,
                    packed.shape().to_vec(),
                    packed.iter().copied().collect(),
                ));
                t.push((
                    "k_scale".into(),
                    Dtype::U8,
                    scale.shape().to_vec(),
                    scale.iter().copied().collect(),
                ));
            }
        }
        t.push((
            "weights".into(),
            Dtype::F32,
            self.weights.shape().to_vec(),
            f32b(&self.weights.iter().copied().collect::<Vec<_>>()),
        ));
        if let Some(s) = &self.k_slots {
            t.push((
                "k_slots".into(),
                Dtype::I32,
                vec![s.len()],
                i32b(&s.to_vec()),
            ));
        }
        let mut a2 = |name: &str, a: &Option<Array2<i32>>| {
            if let Some(a) = a {
                t.push((
                    name.into(),
                    Dtype::I32,
                    a.shape().to_vec(),
                    i32b(&a.iter().copied().collect::<Vec<_>>()),
                ));
            }
        };
        a2("candidates", &self.candidates);
        a2("expected_raw", &self.expected.raw);
        a2("expected_page", &self.expected.page);
        a2("expected_published", &self.expected.published);
        for (name, v) in [
            ("expected_ks", &self.expected.ks),
            ("expected_ke", &self.expected.ke),
            ("expected_published_rows", &self.expected.published_rows),
        ] {
            if let Some(v) = v {
                t.push((name.into(), Dtype::I32, vec![v.len()], i32b(v)));
            }
        }
        if let Some(v) = &self.expected.logits {
            t.push(("expected_logits".into(), Dtype::F32, vec![v.len()], f32b(v)));
        }
        if let Some(e) = &self.engine_logits {
            t.push((
                "engine_logits".into(),
                Dtype::F32,
                e.shape().to_vec(),
                f32b(&e.iter().copied().collect::<Vec<_>>()),
            ));
        }
        let views: Vec<(String, TensorView)> = t
            .iter()
            .map(|(n, dt, s, b)| {
                TensorView::new(*dt, s.clone(), b)
                    .map(|v| (n.clone(), v))
                    .map_err(|e| derr(n, e.to_string()))
            })
            .collect::<Result<_>>()?;
        let bytes = safetensors::serialize(views, Some(self.meta.to_map()))
            .map_err(|e| derr("header", e.to_string()))?;
        canonical_header(bytes)
    }
}
