//! `dump_struct`'s model of a dump: a valid [`Dump`] built from a [`Spec`] (a small
//! arbitrary layer-forward with its expected outputs), its safetensors file as a list of
//! tensors (name, dtype, shape, bytes, optional offsets) with a metadata map, and the
//! structured mutations of that file: those that keep its meaning ([`Keep`]: another
//! accepted dtype for the same values, another order of the data section, header
//! padding, extra keys and tensors, numbers spelt with spaces or leading zeros, a
//! dropped `expected_*` tensor) and those that may break it ([`Break`]: metadata values,
//! shapes, dtypes, offsets, sizes, names, bytes, the header length).

use std::collections::BTreeMap;

use arbitrary::Arbitrary;

use dsa_indexer::dump::{Dump, Expected, KData, Layout, Meta, QData, RoleKind};
use dsa_indexer::problem::{Format, Role};
use dsa_indexer::reference::{self, Output};

use crate::case::Spec;
use crate::Rng;

/// `got` is `want`: the bytes the crate writes of each are the same, and so are the
/// values wherever `want` is equal to itself. (A float tensor may hold a NaN, the
/// reference's logits or a breaking mutation's bytes, and a NaN is not equal to itself
/// under `PartialEq`; the bytes compare it bitwise.)
pub fn assert_same_dump(got: &Dump, want: &Dump, what: &str) {
    assert!(
        got.to_bytes().expect("a parsed dump serialises")
            == want.to_bytes().expect("a parsed dump serialises"),
        "{what}: the bytes written differ"
    );
    #[allow(clippy::eq_op)]
    let reflexive = want == want;
    if reflexive {
        assert_eq!(got, want, "{what}");
    }
}

/// A valid dump of the spec's layer (no defect), and the reference's outputs of its
/// problem. `None` when the spec's consumer has no candidates to take (no source rows).
pub fn dump_of(spec: &Spec) -> Option<(Dump, Output)> {
    let lay = spec.layout();
    let params = spec.params();
    let mut rng = Rng(spec.seed);
    let (h, d) = (lay.heads, lay.dim);
    let layout = match &lay.explicit {
        Some((r, p)) => Layout::Explicit {
            requests: r.clone(),
            positions: p.clone(),
        },
        None => Layout::Contiguous(lay.query_starts.clone()),
    };
    let rows = match &lay.explicit {
        Some((r, _)) => r.len(),
        None => lay
            .seq_lens
            .iter()
            .zip(&lay.query_starts)
            .map(|(s, q)| s - q)
            .sum(),
    };
    let keys: usize = lay.seq_lens.iter().map(|s| s / lay.ratio).sum();
    let owned = spec.queries(&mut rng, rows, h, d);
    let k = spec.keys(&mut rng, keys, d);
    let role = [RoleKind::Plain, RoleKind::Source, RoleKind::Consumer][(spec.role % 3) as usize];
    let meta = Meta {
        heads: h,
        dim: d,
        topk: params.topk,
        ratio: lay.ratio,
        q_format: if spec.q_fp4 {
            Format::E2m1
        } else {
            Format::E4m3
        },
        k_format: if spec.k_fp4 {
            Format::E2m1
        } else {
            Format::E4m3
        },
        role,
        block_size: params.block_size,
        num_blocks: params.num_blocks,
        page_cols: params.page_cols,
        tail: if role == RoleKind::Source {
            spec.tail()
        } else {
            None
        },
        next_n: None,
        description: String::new(),
    };
    let mut dump = Dump {
        meta,
        seq_lens: lay.seq_lens.clone(),
        layout,
        q: match owned.q_scale {
            Some(scale) => QData::E2m1 {
                packed: owned.q,
                scale,
            },
            None => QData::E4m3(owned.q),
        },
        k: match (k.k_scale, k.kscale) {
            (Some(scale), _) => KData::E2m1 { packed: k.k, scale },
            (None, Some(scale)) => KData::E4m3 { codes: k.k, scale },
            (None, None) => unreachable!("E4M3 keys carry their f32 scales"),
        },
        weights: owned.w,
        k_slots: k.slots,
        candidates: None,
        engine_logits: None,
        expected: Expected::default(),
    };
    let batch = dump.batch().expect("a spec's batch is valid");
    if role == RoleKind::Consumer {
        // The candidates a source over the same batch publishes, one row per row.
        let mut src = dump.clone();
        src.meta.role = RoleKind::Source;
        let p = src.problem(&batch, None).expect("a spec's source is valid");
        let published = reference::run(&p).published.expect("a source publishes");
        if published.blocks.nrows() != batch.num_rows() {
            return None;
        }
        dump.candidates = Some(published.blocks);
    }
    let published = dump.published_input(&batch);
    let p = dump
        .problem(&batch, published.as_ref())
        .expect("a spec's problem is valid");
    assert!(
        matches!(
            (role, &p.role),
            (RoleKind::Plain, Role::Plain)
                | (RoleKind::Source, Role::Source { .. })
                | (RoleKind::Consumer, Role::Consumer(_))
        ),
        "role of the built dump"
    );
    let out = reference::run(&p);
    let e = &mut dump.expected;
    e.ks = Some(batch.rows().iter().map(|r| r.ks as i32).collect());
    e.ke = Some(batch.rows().iter().map(|r| r.ke() as i32).collect());
    e.raw = Some(out.raw.clone());
    e.page = Some(out.page.clone());
    e.published = out.published.as_ref().map(|pb| pb.blocks.clone());
    Some((dump, out))
}

/// One tensor of the file.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    /// Its key in the header.
    pub name: String,
    /// Its `dtype` string.
    pub dtype: String,
    /// Its `shape`.
    pub shape: Vec<u64>,
    /// Its bytes.
    pub data: Vec<u8>,
    /// `data_offsets` written instead of the ones its place in the data section gives.
    pub offsets: Option<(u64, u64)>,
}

/// A safetensors file as parts.
#[derive(Debug, Clone, PartialEq)]
pub struct File {
    /// `__metadata__`.
    pub meta: BTreeMap<String, String>,
    /// The tensors in data-section order.
    pub entries: Vec<Entry>,
    /// Spaces after the header's JSON.
    pub pad: usize,
    /// Added to the header length written in the first 8 bytes.
    pub len_delta: i64,
    /// Bytes cut from the end of the file.
    pub cut: usize,
    /// Bytes appended to the data section (not covered by any tensor).
    pub extra: Vec<u8>,
}

impl File {
    /// The parts of a file the crate wrote.
    pub fn parse(bytes: &[u8]) -> File {
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        let data = &bytes[8 + n..];
        let mut meta = BTreeMap::new();
        let mut entries = Vec::new();
        for (k, v) in header.as_object().unwrap() {
            if k == "__metadata__" {
                for (mk, mv) in v.as_object().unwrap() {
                    meta.insert(mk.clone(), mv.as_str().unwrap().to_string());
                }
                continue;
            }
            let o = v["data_offsets"].as_array().unwrap();
            let (a, b) = (o[0].as_u64().unwrap(), o[1].as_u64().unwrap());
            entries.push((
                a,
                Entry {
                    name: k.clone(),
                    dtype: v["dtype"].as_str().unwrap().to_string(),
                    shape: v["shape"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|x| x.as_u64().unwrap())
                        .collect(),
                    data: data[a as usize..b as usize].to_vec(),
                    offsets: None,
                },
            ));
        }
        entries.sort_by_key(|e| e.0);
        File {
            meta,
            entries: entries.into_iter().map(|e| e.1).collect(),
            pad: 0,
            len_delta: 0,
            cut: 0,
            extra: Vec::new(),
        }
    }

    /// The file's bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut header = serde_json::Map::new();
        let mut data = Vec::new();
        for e in &self.entries {
            let at = data.len() as u64;
            data.extend_from_slice(&e.data);
            let (a, b) = e.offsets.unwrap_or((at, data.len() as u64));
            header.insert(
                e.name.clone(),
                serde_json::json!({"dtype": e.dtype, "shape": e.shape, "data_offsets": [a, b]}),
            );
        }
        data.extend_from_slice(&self.extra);
        if !self.meta.is_empty() {
            header.insert(
                "__metadata__".into(),
                serde_json::to_value(&self.meta).unwrap(),
            );
        }
        let mut h = serde_json::to_vec(&header).unwrap();
        h.resize(h.len() + self.pad, b' ');
        let len = (h.len() as i64).saturating_add(self.len_delta) as u64;
        let mut out = len.to_le_bytes().to_vec();
        out.extend(h);
        out.extend(data);
        out.truncate(out.len().saturating_sub(self.cut));
        out
    }

    fn entry(&mut self, name: &str) -> Option<&mut Entry> {
        self.entries.iter_mut().find(|e| e.name == name)
    }
}

/// A mutation that keeps the file's meaning: the dump read back is `want` after
/// [`Keep::apply`] (which updates `want` where the mutation says so).
#[derive(Arbitrary, Debug, Clone)]
pub enum Keep {
    /// Shuffle the data section's order.
    Permute(u64),
    /// Spaces after the header's JSON.
    Pad(u8),
    /// A metadata key the schema does not read.
    ExtraMeta(u8, String),
    /// `cls`, which the reader derives from the formats and ignores.
    Cls(String),
    /// `description`.
    Description(String),
    /// A number spelt with spaces around it or leading zeros.
    Spelling(u8, u8),
    /// Tensor `.0` re-encoded in another accepted dtype (`.1` picks which, and the
    /// padding byte of `I32` scale words).
    Dtype(u8, u8),
    /// A tensor the schema does not read.
    ExtraTensor(u8, u8),
    /// An `expected_*` tensor left out.
    DropExpected(u8),
}

/// The metadata keys that hold numbers.
const NUM_KEYS: [&str; 8] = [
    "heads",
    "dim",
    "topk",
    "ratio",
    "block_size",
    "num_blocks",
    "page_cols",
    "tail",
];

/// Every metadata key the schema reads, and `cls`.
const META_KEYS: [&str; 13] = [
    "heads",
    "dim",
    "topk",
    "ratio",
    "block_size",
    "num_blocks",
    "page_cols",
    "tail",
    "q_format",
    "k_format",
    "role",
    "description",
    "cls",
];

/// Every tensor name of the schema.
pub const TENSORS: [&str; 19] = [
    "seq_lens",
    "query_starts",
    "row_requests",
    "row_positions",
    "q",
    "q_scale",
    "k",
    "k_scale",
    "weights",
    "k_slots",
    "candidates",
    "engine_logits",
    "expected_ks",
    "expected_ke",
    "expected_logits",
    "expected_raw",
    "expected_page",
    "expected_published",
    "expected_published_rows",
];

/// The dtype strings of safetensors, and some that are not.
const DTYPES: [&str; 20] = [
    "BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2", "I16", "U16",
    "F16", "BF16", "I32", "U32", "F32", "F64", "I64", "U64", "u8",
];

impl Keep {
    /// Apply to `f`, keeping `want` the dump that `f` holds.
    pub fn apply(&self, f: &mut File, want: &mut Dump) {
        match self {
            Keep::Permute(seed) => {
                let mut rng = Rng(*seed);
                for i in (1..f.entries.len()).rev() {
                    f.entries.swap(i, rng.below(i + 1));
                }
            }
            Keep::Pad(n) => f.pad = *n as usize,
            Keep::ExtraMeta(k, v) => {
                f.meta.insert(format!("x_{k}"), v.clone());
            }
            Keep::Cls(v) => {
                f.meta.insert("cls".into(), v.clone());
            }
            Keep::Description(v) => {
                f.meta.insert("description".into(), v.clone());
                want.meta.description = v.clone();
            }
            Keep::Spelling(k, style) => {
                let key = NUM_KEYS[*k as usize % NUM_KEYS.len()];
                if let Some(v) = f.meta.get_mut(key) {
                    let n = v.trim().trim_start_matches('0');
                    let n = if n.is_empty() { "0" } else { n };
                    *v = match style % 4 {
                        0 => format!(" {n}"),
                        1 => format!("{n} \t"),
                        2 => format!("00{n}"),
                        _ => format!("\n0{n} "),
                    };
                }
            }
            Keep::Dtype(t, variant) => reencode(f, want, *t, *variant),
            Keep::ExtraTensor(dt, n) => {
                let dtype = ["U8", "I32", "F32", "BF16"][*dt as usize % 4];
                let size = match dtype {
                    "U8" => 1,
                    "BF16" => 2,
                    _ => 4,
                };
                // Header keys are unique.
                let name = format!("extra_{}", f.entries.len());
                f.entries.retain(|e| e.name != name);
                f.entries.push(Entry {
                    name,
                    dtype: dtype.into(),
                    shape: vec![*n as u64],
                    data: vec![*n; *n as usize * size],
                    offsets: None,
                });
            }
            Keep::DropExpected(i) => {
                let names: Vec<String> = f
                    .entries
                    .iter()
                    .map(|e| e.name.clone())
                    .filter(|n| n.starts_with("expected_"))
                    .collect();
                if names.is_empty() {
                    return;
                }
                let name = &names[*i as usize % names.len()];
                f.entries.retain(|e| &e.name != name);
                let e = &mut want.expected;
                match name.as_str() {
                    "expected_ks" => e.ks = None,
                    "expected_ke" => e.ke = None,
                    "expected_raw" => e.raw = None,
                    "expected_page" => e.page = None,
                    "expected_published" => e.published = None,
                    other => panic!("the built dump has no {other}"),
                }
            }
        }
    }
}

/// Tensor `t % len` in another dtype the reader accepts for it, same values: E4M3
/// codes as `F8_E4M3`; packed fp4 as `I8` or as `F4` (shape in elements); UE8M0 scales
/// as `F8_E8M0` or as `I32` words (byte `g` = group `g`, the padding bytes `variant`);
/// fp8 key scales as `[L, 1]`; weights as `BF16` when every weight is a bf16 value.
fn reencode(f: &mut File, want: &Dump, t: u8, variant: u8) {
    let i = t as usize % f.entries.len();
    let (qf, kf) = (want.meta.q_format, want.meta.k_format);
    let g = want.meta.dim / 32;
    let e = &mut f.entries[i];
    if e.offsets.is_some() {
        return;
    }
    let fmt = match e.name.as_str() {
        "q" | "q_scale" => qf,
        _ => kf,
    };
    match (e.name.as_str(), e.dtype.as_str(), fmt) {
        ("q" | "k", "U8", Format::E4m3) => e.dtype = "F8_E4M3".into(),
        ("q" | "k", "U8", Format::E2m1) => {
            if variant.is_multiple_of(2) {
                e.dtype = "I8".into();
            } else {
                e.dtype = "F4".into();
                *e.shape.last_mut().unwrap() *= 2;
            }
        }
        ("q_scale" | "k_scale", "U8", Format::E2m1) => {
            if variant.is_multiple_of(3) {
                e.dtype = "F8_E8M0".into();
            } else {
                // One little-endian word per row: its byte g is group g.
                e.dtype = "I32".into();
                e.data = e
                    .data
                    .chunks(g)
                    .flat_map(|c| {
                        let mut w = [variant; 4];
                        w[..g].copy_from_slice(c);
                        w
                    })
                    .collect();
                if variant % 3 == 1 {
                    e.shape.pop();
                } else {
                    *e.shape.last_mut().unwrap() = 1;
                }
            }
        }
        ("k_scale", "F32", Format::E4m3) if e.shape.len() == 1 => e.shape.push(1),
        ("weights", "F32", _) => {
            let words: Vec<u32> = e
                .data
                .chunks(4)
                .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            if words.iter().all(|w| w & 0xFFFF == 0) {
                e.dtype = "BF16".into();
                e.data = words
                    .iter()
                    .flat_map(|w| ((w >> 16) as u16).to_le_bytes())
                    .collect();
            }
        }
        _ => {}
    }
}

/// A metadata value.
#[derive(Arbitrary, Debug, Clone)]
pub enum MetaValue {
    /// A small number.
    Small(u8),
    /// Any `u32`.
    Num(u32),
    /// `-n`.
    Negative(u8),
    /// Past `usize::MAX`.
    Huge,
    /// A format or role name, or another word.
    Word(u8),
    /// Any text.
    Text(String),
}

/// A mutation that may break the file.
#[derive(Arbitrary, Debug, Clone)]
pub enum Break {
    /// Metadata key `.0` set.
    SetMeta(u8, MetaValue),
    /// Metadata key `.0` removed.
    RemoveMeta(u8),
    /// Tensor `.0`'s dtype string.
    SetDtype(u8, u8),
    /// Tensor `.0`'s dimension `.1` set to `.2`, its bytes unchanged.
    SetDim(u8, u8, u16),
    /// Tensor `.0`'s dimension `.1` set to `.2`, its bytes resized to match.
    Reshape(u8, u8, u8),
    /// A dimension appended to tensor `.0`.
    PushDim(u8, u16),
    /// Tensor `.0`'s last dimension removed.
    PopDim(u8),
    /// Tensor `.0`'s `data_offsets`.
    SetOffsets(u8, u32, u32),
    /// Tensor `.0`'s `data_offsets` moved by `.1` bytes.
    ShiftOffsets(u8, i16),
    /// Tensor `.0`'s bytes grown or shrunk by `.1`, shape unchanged.
    Resize(u8, i8),
    /// Tensor `.0` removed.
    Drop(u8),
    /// Tensor `.0` renamed to schema name `.1`.
    Rename(u8, u8),
    /// Byte `.1` of tensor `.0` set to `.2`.
    SetByte(u8, u16, u8),
    /// The file cut short by `.0` bytes.
    Cut(u16),
    /// Bytes after the last tensor.
    Append(u8),
    /// The header length off by `.0`.
    HeaderLen(i16),
}

impl Break {
    /// Apply to `f`.
    pub fn apply(&self, f: &mut File) {
        let n = f.entries.len();
        if n == 0 {
            return;
        }
        let pick = |t: u8| t as usize % n;
        match self {
            Break::SetMeta(k, v) => {
                let key = META_KEYS[*k as usize % META_KEYS.len()];
                let v = match v {
                    MetaValue::Small(x) => x.to_string(),
                    MetaValue::Num(x) => x.to_string(),
                    MetaValue::Negative(x) => format!("-{x}"),
                    MetaValue::Huge => "18446744073709551616".into(),
                    MetaValue::Word(w) => [
                        "e4m3", "e2m1", "E4M3", "fp8", "plain", "source", "consumer", "", "1.5",
                        "0x10",
                    ][*w as usize % 10]
                        .into(),
                    MetaValue::Text(s) => s.clone(),
                };
                f.meta.insert(key.into(), v);
            }
            Break::RemoveMeta(k) => {
                f.meta.remove(META_KEYS[*k as usize % META_KEYS.len()]);
            }
            Break::SetDtype(t, d) => {
                f.entries[pick(*t)].dtype = DTYPES[*d as usize % DTYPES.len()].into()
            }
            Break::SetDim(t, i, v) => {
                let e = &mut f.entries[pick(*t)];
                if !e.shape.is_empty() {
                    let i = *i as usize % e.shape.len();
                    e.shape[i] = *v as u64;
                }
            }
            Break::Reshape(t, i, v) => {
                let e = &mut f.entries[pick(*t)];
                if !e.shape.is_empty() {
                    let i = *i as usize % e.shape.len();
                    let elems: u64 = e.shape.iter().product();
                    let per = (e.data.len() as u64).checked_div(elems).unwrap_or(0);
                    e.shape[i] = *v as u64;
                    let want: u64 = e.shape.iter().product::<u64>() * per;
                    e.data.resize(want as usize, 0x11);
                }
            }
            Break::PushDim(t, v) => f.entries[pick(*t)].shape.push(*v as u64),
            Break::PopDim(t) => {
                f.entries[pick(*t)].shape.pop();
            }
            Break::SetOffsets(t, a, b) => {
                f.entries[pick(*t)].offsets = Some((*a as u64, *b as u64));
            }
            Break::ShiftOffsets(t, by) => {
                let i = pick(*t);
                let at: u64 = f.entries[..i].iter().map(|e| e.data.len() as u64).sum();
                let len = f.entries[i].data.len() as u64;
                let s = |x: u64| x.saturating_add_signed(*by as i64);
                f.entries[i].offsets = Some((s(at), s(at + len)));
            }
            Break::Resize(t, by) => {
                let e = &mut f.entries[pick(*t)];
                let len = (e.data.len() as i64 + *by as i64).max(0) as usize;
                e.data.resize(len, 0x22);
            }
            Break::Drop(t) => {
                f.entries.remove(pick(*t));
            }
            Break::Rename(t, s) => {
                let name = TENSORS[*s as usize % TENSORS.len()];
                let old = f.entries[pick(*t)].name.clone();
                if old != name {
                    // Header keys are unique: the renamed tensor replaces any of that name.
                    f.entries.retain(|e| e.name != name);
                    if let Some(e) = f.entry(&old) {
                        e.name = name.into();
                    }
                }
            }
            Break::SetByte(t, at, v) => {
                let e = &mut f.entries[pick(*t)];
                if !e.data.is_empty() {
                    let at = *at as usize % e.data.len();
                    e.data[at] = *v;
                }
            }
            Break::Cut(n) => f.cut = *n as usize,
            Break::Append(n) => f.extra = vec![0x33; *n as usize],
            Break::HeaderLen(d) => f.len_delta = *d as i64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::case::seeds;

    /// Every meaning-keeping mutation, alone, on every seed layer: the file reads back
    /// as the dump it should hold; and every accepted dtype and the I32 words' padding
    /// are really written by some seed (so `dump_struct` exercises each).
    #[test]
    fn each_kept_mutation_reads_back_as_the_same_dump() {
        let mut keeps: Vec<Keep> = vec![
            Keep::Permute(3),
            Keep::Permute(u64::MAX),
            Keep::Pad(7),
            Keep::ExtraMeta(1, "x".into()),
            Keep::Cls("exact".into()),
            Keep::Description("a \"quoted\" description\n".into()),
        ];
        keeps.extend((0..4).flat_map(|k| (0..4).map(move |s| Keep::Spelling(k, s))));
        keeps.extend((0..16).flat_map(|t| (0..6).map(move |v| Keep::Dtype(t, v))));
        keeps.extend((0..4).map(|d| Keep::ExtraTensor(d, 5)));
        keeps.extend((0..6).map(Keep::DropExpected));
        let mut dtypes = std::collections::BTreeSet::new();
        let mut layers = 0;
        for (name, spec) in seeds() {
            if spec.defect().is_some() {
                continue;
            }
            let Some((dump, _)) = dump_of(&spec) else {
                continue;
            };
            layers += 1;
            let bytes = dump.to_bytes().unwrap();
            let base = File::parse(&bytes);
            let again = Dump::from_bytes(&base.to_bytes()).unwrap();
            assert!(again == dump, "{name}: the parts write the same dump");
            for k in &keeps {
                let (mut f, mut want) = (base.clone(), dump.clone());
                k.apply(&mut f, &mut want);
                dtypes.extend(f.entries.iter().map(|e| e.dtype.clone()));
                let got = Dump::from_bytes(&f.to_bytes())
                    .unwrap_or_else(|e| panic!("{name}: {k:?} rejected: {e}"));
                assert!(got == want, "{name}: {k:?} reads as another dump");
            }
        }
        assert!(layers > 20, "{layers} seed layers");
        let want: Vec<&str> = vec!["BF16", "F32", "F4", "F8_E4M3", "F8_E8M0", "I32", "I8", "U8"];
        assert_eq!(dtypes.iter().map(|s| s.as_str()).collect::<Vec<_>>(), want);
    }

    /// A mutation that breaks the file is an error naming the tensor it broke.
    #[test]
    fn a_broken_tensor_is_named() {
        let (_, spec) = seeds()
            .into_iter()
            .find(|(_, s)| s.defect().is_none())
            .unwrap();
        let (dump, _) = dump_of(&spec).unwrap();
        let base = File::parse(&dump.to_bytes().unwrap());
        let i = base
            .entries
            .iter()
            .position(|e| e.name == "weights")
            .unwrap() as u8;
        for (b, want) in [
            (Break::SetDtype(i, 0), "weights"),
            (Break::Resize(i, -4), "weights"),
            (Break::PopDim(i), "weights"),
            (Break::Drop(i), "weights"),
            (Break::RemoveMeta(0), "__metadata__"),
            (Break::HeaderLen(1), "header"),
        ] {
            let mut f = base.clone();
            b.apply(&mut f);
            match Dump::from_bytes(&f.to_bytes()) {
                Err(dsa_indexer::Error::Dump { tensor, .. }) => assert_eq!(tensor, want, "{b:?}"),
                other => panic!("{b:?}: {other:?}"),
            }
        }
    }
}
