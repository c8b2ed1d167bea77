//! Writing a dump: a [`Dump`] to `safetensors` bytes, the header's keys sorted so that
//! equal dumps are equal bytes.

use ndarray::Array2;
use safetensors::tensor::{Dtype, TensorView};

use super::derr;
use super::schema::{Dump, KData, Layout, QData};
use crate::error::{Error, Result};

/// One tensor to write: name, dtype, shape, little-endian bytes.
type Tensor = (String, Dtype, Vec<usize>, Vec<u8>);

fn i32_bytes(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn f32_bytes<'a>(v: impl IntoIterator<Item = &'a f32>) -> Vec<u8> {
    v.into_iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// An I32 tensor `name [v.len()]` of sizes or positions; a value past `i32::MAX` is an
/// error naming `name[i]` and the value.
fn usize_tensor(name: &str, v: &[usize]) -> Result<Tensor> {
    let words = v
        .iter()
        .enumerate()
        .map(|(i, &x)| {
            i32::try_from(x).map_err(|_| {
                Error::range(
                    format!("{name}[{i}]"),
                    x,
                    "at most 2^31 - 1, the largest I32 value",
                )
            })
        })
        .collect::<Result<Vec<i32>>>()?;
    Ok((name.into(), Dtype::I32, vec![v.len()], i32_bytes(&words)))
}

fn u8_tensor<'a>(name: &str, shape: &[usize], v: impl IntoIterator<Item = &'a u8>) -> Tensor {
    (
        name.into(),
        Dtype::U8,
        shape.to_vec(),
        v.into_iter().copied().collect(),
    )
}

fn i32_2d_tensor(name: &str, a: &Array2<i32>) -> Tensor {
    (
        name.into(),
        Dtype::I32,
        a.shape().to_vec(),
        i32_bytes(&a.iter().copied().collect::<Vec<_>>()),
    )
}

/// The same file with its JSON header's keys sorted (metadata included), so that equal
/// dumps are equal bytes: `safetensors` writes the metadata map in hash order. The
/// header stays padded with spaces to a multiple of 8 bytes; data offsets are relative
/// to the data section and do not move.
fn canonical_header(bytes: Vec<u8>) -> Result<Vec<u8>> {
    let bad = |what: &str| derr("header", format!("re-serializing: {what}"));
    let head: [u8; 8] = bytes
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| bad("short file"))?;
    let n = usize::try_from(u64::from_le_bytes(head)).map_err(|_| bad("header length"))?;
    let header = bytes
        .get(8..8usize.saturating_add(n))
        .ok_or_else(|| bad("short header"))?;
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

impl Dump {
    /// The tensors of the dump, in the order they are written.
    fn tensors(&self) -> Result<Vec<Tensor>> {
        let mut t: Vec<Tensor> = vec![usize_tensor("seq_lens", &self.seq_lens)?];
        match &self.layout {
            Layout::Contiguous(q0) => t.push(usize_tensor("query_starts", q0)?),
            Layout::Explicit {
                requests,
                positions,
            } => {
                t.push(usize_tensor("row_requests", requests)?);
                t.push(usize_tensor("row_positions", positions)?);
            }
        }
        match &self.q {
            QData::E4m3(q) => t.push(u8_tensor("q", q.shape(), q)),
            QData::E2m1 { packed, scale } => {
                t.push(u8_tensor("q", packed.shape(), packed));
                t.push(u8_tensor("q_scale", scale.shape(), scale));
            }
        }
        match &self.k {
            KData::E4m3 { codes, scale } => {
                t.push(u8_tensor("k", codes.shape(), codes));
                t.push((
                    "k_scale".into(),
                    Dtype::F32,
                    vec![scale.len()],
                    f32_bytes(scale),
                ));
            }
            KData::E2m1 { packed, scale } => {
                t.push(u8_tensor("k", packed.shape(), packed));
                t.push(u8_tensor("k_scale", scale.shape(), scale));
            }
            KData::Paged {
                kv_cache,
                page_table,
                ..
            } => {
                t.push(u8_tensor("kv_cache", kv_cache.shape(), kv_cache));
                t.push(i32_2d_tensor("page_table", page_table));
            }
        }
        t.push((
            "weights".into(),
            Dtype::F32,
            self.weights.shape().to_vec(),
            f32_bytes(&self.weights),
        ));
        if let Some(s) = &self.k_slots {
            let v: Vec<i32> = s.to_vec();
            t.push(("k_slots".into(), Dtype::I32, vec![s.len()], i32_bytes(&v)));
        }
        let e = &self.expected;
        for (name, a) in [
            ("candidates", &self.candidates),
            ("expected_raw", &e.raw),
            ("expected_page", &e.page),
            ("expected_published", &e.published),
        ] {
            if let Some(a) = a {
                t.push(i32_2d_tensor(name, a));
            }
        }
        for (name, v) in [
            ("expected_ks", &e.ks),
            ("expected_ke", &e.ke),
            ("expected_published_rows", &e.published_rows),
        ] {
            if let Some(v) = v {
                t.push((name.into(), Dtype::I32, vec![v.len()], i32_bytes(v)));
            }
        }
        if let Some(v) = &e.logits {
            t.push((
                "expected_logits".into(),
                Dtype::F32,
                vec![v.len()],
                f32_bytes(v),
            ));
        }
        if let Some(m) = &self.engine_logits {
            t.push((
                "engine_logits".into(),
                Dtype::F32,
                m.shape().to_vec(),
                f32_bytes(m),
            ));
        }
        Ok(t)
    }

    /// Serialise to safetensors bytes. A size or position that does not fit the
    /// schema's I32 (`seq_lens`, `query_starts`, `row_requests`, `row_positions`) is an
    /// [`Error::OutOfRange`] naming the entry and its value.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let t = self.tensors()?;
        let views: Vec<(String, TensorView)> = t
            .iter()
            .map(|(n, dt, s, b)| {
                TensorView::new(*dt, s.clone(), b)
                    .map(|v| (n.clone(), v))
                    .map_err(|e| derr(n, e.to_string()))
            })
            .collect::<Result<_>>()?;
        let mut meta = self.meta.to_map();
        if let KData::Paged { page_size, .. } = &self.k {
            meta.insert("page_size".into(), page_size.to_string());
            meta.insert("layout".into(), "paged".into());
        }
        let bytes =
            safetensors::serialize(views, Some(meta)).map_err(|e| derr("header", e.to_string()))?;
        canonical_header(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dump::{Expected, Meta};
    use ndarray::{Array1, Array3};

    /// One request of `seq_len` tokens, its last row a query; fp8 x fp8, H = 8, D = 32.
    fn dump(seq_len: usize, query_start: usize) -> Dump {
        Dump {
            meta: Meta::plain_e4m3_h8_d32(1),
            seq_lens: vec![seq_len],
            layout: Layout::Contiguous(vec![query_start]),
            q: QData::E4m3(Array3::from_elem((1, 8, 32), 0x38)),
            k: KData::E4m3 {
                codes: Array2::from_elem((2, 32), 0x38),
                scale: Array1::from_elem(2, 1.0),
            },
            weights: Array2::from_elem((1, 8), 1.0),
            k_slots: None,
            candidates: None,
            engine_logits: None,
            expected: Expected::default(),
        }
    }

    #[test]
    fn a_size_past_i32_is_an_error_naming_the_entry_and_value() {
        let big = i32::MAX as usize + 1;
        let err = dump(big, big - 1).to_bytes().unwrap_err();
        assert_eq!(
            err,
            Error::OutOfRange {
                field: "seq_lens[0]".into(),
                value: big.to_string(),
                expected: "at most 2^31 - 1, the largest I32 value",
            }
        );
        let mut d = dump(2, 1);
        d.layout = Layout::Explicit {
            requests: vec![0],
            positions: vec![big],
        };
        match d.to_bytes().unwrap_err() {
            Error::OutOfRange { field, value, .. } => {
                assert_eq!(
                    (field.as_str(), value),
                    ("row_positions[0]", big.to_string())
                )
            }
            e => panic!("{e}"),
        }
    }

    #[test]
    fn i32_max_is_written_and_read_back() {
        let top = i32::MAX as usize;
        let d = dump(top, top - 1);
        let back = Dump::from_bytes(&d.to_bytes().unwrap()).unwrap();
        assert_eq!(back, d);
    }
}
