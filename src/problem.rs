//! Inputs of one layer-forward (SPEC 4), their validation, and the layer's role (SPEC 6).

use ndarray::{Array2, ArrayView1, ArrayView2, ArrayView3, Axis};

use crate::batch::Batch;
use crate::batch::Row;
use crate::error::{Error, Result};
use crate::formats::e4m3;
use crate::paged::PagedKeys;

/// Query values.
#[derive(Debug, Clone, Copy)]
pub enum Queries<'a> {
    /// E4M3 bytes `[T, H, D]` (no scale: fold it into the weights).
    E4m3(ArrayView3<'a, u8>),
    /// Packed E2M1 `[T, H, D/2]` and UE8M0 group scales `[T, H, D/32]`.
    E2m1 {
        /// Packed codes, element `2i` in the low nibble.
        packed: ArrayView3<'a, u8>,
        /// One UE8M0 byte per 32 elements.
        scale: ArrayView3<'a, u8>,
    },
}

/// Key values, requests concatenated.
#[derive(Debug, Clone, Copy)]
pub enum Keys<'a> {
    /// E4M3 bytes `[L, D]` and one f32 scale per key `[L]` (finite, > 0).
    E4m3 {
        /// E4M3 bytes.
        codes: ArrayView2<'a, u8>,
        /// Per-key scale.
        scale: ArrayView1<'a, f32>,
    },
    /// Packed E2M1 `[L, D/2]` and UE8M0 group scales `[L, D/32]`.
    E2m1 {
        /// Packed codes.
        packed: ArrayView2<'a, u8>,
        /// One UE8M0 byte per 32 elements.
        scale: ArrayView2<'a, u8>,
    },
    /// E4M3 or E2M1 keys in a page pool through a page table (SPEC 10).
    Paged(PagedKeys<'a>),
}

/// One key's data, wherever it is stored.
#[derive(Debug, Clone, Copy)]
pub enum KeyRef<'a> {
    /// `D` E4M3 bytes and the per-key scale.
    E4m3 {
        /// E4M3 bytes.
        codes: ArrayView1<'a, u8>,
        /// Per-key scale.
        scale: f32,
    },
    /// `D/2` packed E2M1 bytes and `G` UE8M0 group scales.
    E2m1 {
        /// Packed codes.
        packed: ArrayView1<'a, u8>,
        /// Group scales.
        scale: ArrayView1<'a, u8>,
    },
}

impl KeyRef<'_> {
    /// The per-key scale (E4M3 keys), or 1.
    pub fn kscale(&self) -> f32 {
        match self {
            KeyRef::E4m3 { scale, .. } => *scale,
            KeyRef::E2m1 { .. } => 1.0,
        }
    }
}

/// The four format pairs fall into two classes (SPEC 4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// fp4 x fp4: logits are exact functions of the inputs, bitwise on every backend.
    Exact,
    /// Any E4M3 side: f64 group sums on the reference, a stated bound elsewhere.
    Tolerance,
}

/// Element format of one side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// `float8_e4m3fn`.
    E4m3,
    /// fp4 with UE8M0 scales per 32 elements.
    E2m1,
}

impl std::fmt::Display for Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Format::E4m3 => "e4m3",
            Format::E2m1 => "e2m1",
        })
    }
}

/// Everything the logits read.
#[derive(Debug, Clone, Copy)]
pub struct Inputs<'a> {
    /// Queries `[T, H, ..]`.
    pub q: Queries<'a>,
    /// Keys `[L, ..]`.
    pub k: Keys<'a>,
    /// Head weights `[T, H]`, finite, any sign.
    pub weights: ArrayView2<'a, f32>,
    /// Pool slot of each flat key `[L]`, each `>= 0`; `None` is the identity.
    pub k_slots: Option<ArrayView1<'a, i32>>,
}

/// Published candidate blocks of a source layer (SPEC 6): the input of its consumers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    /// `B`.
    pub block_size: usize,
    /// `r` of the source's batch.
    pub ratio: usize,
    /// `S_b` of the source's batch.
    pub seq_lens: Vec<usize>,
    /// `(request, position)` of each published row.
    pub rows: Vec<(usize, usize)>,
    /// Kept block ids ascending, `-1`-padded: `[P, NB]`.
    pub blocks: Array2<i32>,
}

impl Published {
    /// Candidates given for every row of `batch` in order (a consumer from a dump).
    pub fn for_batch(batch: &Batch, block_size: usize, blocks: Array2<i32>) -> Self {
        Published {
            block_size,
            ratio: batch.ratio(),
            seq_lens: batch.seq_lens(),
            rows: batch
                .rows()
                .iter()
                .map(|r| (r.request, r.position))
                .collect(),
            blocks,
        }
    }

    /// `NB`: the width of the published rows.
    pub fn num_blocks(&self) -> usize {
        self.blocks.ncols()
    }

    /// Dense view of published row `i`: `bool [lc_b]`, key `j` kept iff its block is kept.
    pub fn dense_row(&self, i: usize) -> Vec<bool> {
        let (b, _) = self.rows[i];
        let keys = self.seq_lens[b] / self.ratio;
        let mut m = vec![false; keys];
        for &c in self.blocks.row(i).iter().filter(|&&c| c >= 0) {
            let lo = (c as usize).saturating_mul(self.block_size).min(keys);
            let hi = lo.saturating_add(self.block_size).min(keys);
            m[lo..hi].iter_mut().for_each(|x| *x = true);
        }
        m
    }
}

/// What the layer does besides its own top-k (SPEC 6).
#[derive(Debug, Clone, Copy)]
pub enum Role<'a> {
    /// Top-k only.
    Plain,
    /// Top-k, and publish candidate blocks for the rows at the last `tail`
    /// positions of each request (all rows when `None`).
    Source {
        /// `tail >= 1`, or `None` for all rows.
        tail: Option<usize>,
    },
    /// Top-k restricted to a source's published blocks, row `i` using published row `i`.
    Consumer(&'a Published),
}

impl Role<'_> {
    /// `plain`, `source` or `consumer`.
    pub fn name(&self) -> &'static str {
        match self {
            Role::Plain => "plain",
            Role::Source { .. } => "source",
            Role::Consumer(_) => "consumer",
        }
    }
}

/// Scalar parameters of a layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Params {
    /// `K`: keys selected per row.
    pub topk: usize,
    /// Width of `page` (`>= K`); `None` is `K` rounded up to a multiple of 64.
    pub page_cols: Option<usize>,
    /// `B`: keys per candidate block.
    pub block_size: usize,
    /// `NB`: candidate blocks kept per published row.
    pub num_blocks: usize,
}

impl Params {
    /// `K` with the model defaults `B = 8`, `NB = 2048`.
    pub fn new(topk: usize) -> Self {
        Params {
            topk,
            page_cols: None,
            block_size: 8,
            num_blocks: 2048,
        }
    }
}

/// Largest `K` the reference accepts: its top-k keeps `K` entries per row in flight.
pub const MAX_TOPK: usize = 1 << 16;

/// Widest `page` row (SPEC 8): `page_cols` past it is an error, not an allocation of
/// `T x page_cols` ids (the default, `K` rounded up to 64, never reaches it).
pub const MAX_PAGE_COLS: usize = 1 << 16;
const _: () = assert!(
    MAX_PAGE_COLS == 65536 && MAX_NUM_BLOCKS == 65536,
    "the messages say 65536"
);

/// Most candidate blocks kept per published row (SPEC 8): `NB` past it is an error, not
/// an allocation of `rows x NB` block ids (the model's `NB` is 2048).
pub const MAX_NUM_BLOCKS: usize = 1 << 16;

/// `NB` must lie in `1 ..= MAX_NUM_BLOCKS`; an error naming `num_blocks` otherwise.
pub fn check_num_blocks(num_blocks: usize) -> Result<()> {
    if num_blocks == 0 {
        return Err(Error::range("num_blocks", 0, "num_blocks >= 1"));
    }
    if num_blocks > MAX_NUM_BLOCKS {
        return Err(Error::range(
            "num_blocks",
            num_blocks,
            "num_blocks <= 65536",
        ));
    }
    Ok(())
}

/// The width of `page` for `K = topk` (SPEC 5): `page_cols`, which must lie in
/// `topk ..= MAX_PAGE_COLS`, or by default `K` rounded up to a multiple of 64.
pub fn page_cols_for(topk: usize, page_cols: Option<usize>) -> Result<usize> {
    match page_cols {
        Some(c) if c < topk => Err(Error::range("page_cols", c, "page_cols >= topk")),
        Some(c) if c > MAX_PAGE_COLS => Err(Error::range("page_cols", c, "page_cols <= 65536")),
        Some(c) => Ok(c),
        None => Ok(topk.div_ceil(64) * 64),
    }
}

/// A validated layer-forward: a batch, its inputs, parameters and role.
#[derive(Debug, Clone, Copy)]
pub struct Problem<'a> {
    /// The batch.
    pub batch: &'a Batch,
    /// Inputs, shapes checked.
    pub inputs: Inputs<'a>,
    /// `H`.
    pub heads: usize,
    /// `D`.
    pub dim: usize,
    /// `K`.
    pub topk: usize,
    /// Width of `page`, resolved.
    pub page_cols: usize,
    /// `B`.
    pub block_size: usize,
    /// `NB`.
    pub num_blocks: usize,
    /// Role.
    pub role: Role<'a>,
}

fn check_shape(field: &str, got: &[usize], expected: &[usize]) -> Result<()> {
    if got != expected {
        return Err(Error::shape(field, got, expected));
    }
    Ok(())
}

fn check_e4m3(field: &str, v: impl Iterator<Item = u8>) -> Result<()> {
    for (index, byte) in v.enumerate() {
        if e4m3::is_nan_code(byte) {
            return Err(Error::nan_e4m3(field, index, byte));
        }
    }
    Ok(())
}

fn check_ue8m0(field: &str, v: impl Iterator<Item = u8>) -> Result<()> {
    for (index, byte) in v.enumerate() {
        if byte == 255 {
            return Err(Error::reserved_scale(field, index));
        }
    }
    Ok(())
}

impl<'a> Problem<'a> {
    /// Validate everything once (SPEC 8); afterwards the computation trusts the types.
    pub fn new(
        batch: &'a Batch,
        inputs: Inputs<'a>,
        params: Params,
        role: Role<'a>,
    ) -> Result<Self> {
        let t = batch.num_rows();
        let l = batch.num_keys();
        // raw and page are i32: every key index and identity slot must fit.
        if l > i32::MAX as usize {
            return Err(Error::range(
                "keys L",
                l,
                "at most 2^31 - 1 keys in a batch (outputs are i32)",
            ));
        }
        // H and D from the queries.
        let (qshape, dim) = match inputs.q {
            Queries::E4m3(q) => (q.shape().to_vec(), q.shape()[2]),
            Queries::E2m1 { packed, .. } => (
                packed.shape().to_vec(),
                packed.shape()[2]
                    .checked_mul(2)
                    .ok_or_else(|| Error::overflow("dim"))?,
            ),
        };
        let heads = qshape[1];
        if !(heads.is_power_of_two() && (8..=64).contains(&heads)) {
            return Err(Error::range(
                "heads",
                heads,
                "a power of two in 8..=64 (q.shape[1])",
            ));
        }
        if ![32, 64, 128].contains(&dim) {
            return Err(Error::range("dim", dim, "32, 64 or 128"));
        }
        let g = dim / 32;
        match inputs.q {
            Queries::E4m3(q) => {
                check_shape("q", q.shape(), &[t, heads, dim])?;
                check_e4m3("q", q.iter().copied())?;
            }
            Queries::E2m1 { packed, scale } => {
                check_shape("q", packed.shape(), &[t, heads, dim / 2])?;
                check_shape("q_scale", scale.shape(), &[t, heads, g])?;
                check_ue8m0("q_scale", scale.iter().copied())?;
            }
        }
        match inputs.k {
            Keys::E4m3 { codes, scale } => {
                check_shape("k", codes.shape(), &[l, dim])?;
                check_shape("k_scale", scale.shape(), &[l])?;
                check_e4m3("k", codes.iter().copied())?;
                for (index, &v) in scale.iter().enumerate() {
                    if !(v.is_finite() && v > 0.0) {
                        return Err(Error::bad_key_scale(index, v));
                    }
                }
            }
            Keys::E2m1 { packed, scale } => {
                check_shape("k", packed.shape(), &[l, dim / 2])?;
                check_shape("k_scale", scale.shape(), &[l, g])?;
                check_ue8m0("k_scale", scale.iter().copied())?;
            }
            Keys::Paged(pk) => {
                if inputs.k_slots.is_some() {
                    return Err(Error::range(
                        "k_slots",
                        "given",
                        "none with paged keys: page reports pool slots (SPEC 10)",
                    ));
                }
                pk.validate(batch, dim)?;
            }
        }
        check_shape("weights", inputs.weights.shape(), &[t, heads])?;
        for (index, &v) in inputs.weights.iter().enumerate() {
            if !v.is_finite() {
                return Err(Error::bad_weight(index, v));
            }
        }
        if let Some(slots) = inputs.k_slots {
            check_shape("k_slots", slots.shape(), &[l])?;
            if let Some((index, &v)) = slots.iter().enumerate().find(|(_, &v)| v < 0) {
                return Err(Error::negative_slot(index, v));
            }
        }
        if params.topk == 0 || params.topk > MAX_TOPK {
            return Err(Error::range("topk", params.topk, "1 ..= 65536"));
        }
        let page_cols = page_cols_for(params.topk, params.page_cols)?;
        if params.block_size == 0 {
            return Err(Error::range("block_size", 0, "block_size >= 1"));
        }
        check_num_blocks(params.num_blocks)?;
        // Output sizes must be addressable.
        crate::error::mul(t, page_cols, "page [T, page_cols]")?;
        crate::error::mul(crate::error::mul(t, heads, "q")?, dim, "q")?;
        match role {
            Role::Plain => {}
            Role::Source { tail } => {
                if tail == Some(0) {
                    return Err(Error::range("tail", 0, "tail >= 1"));
                }
                crate::error::mul(t, params.num_blocks, "published [rows, NB]")?;
            }
            Role::Consumer(p) => validate_consumer(batch, p, params)?,
        }
        Ok(Problem {
            batch,
            inputs,
            heads,
            dim,
            topk: params.topk,
            page_cols,
            block_size: params.block_size,
            num_blocks: params.num_blocks,
            role,
        })
    }

    /// Exact or tolerance class.
    pub fn class(&self) -> Class {
        match (self.q_format(), self.k_format()) {
            (Format::E2m1, Format::E2m1) => Class::Exact,
            _ => Class::Tolerance,
        }
    }

    /// Format of the queries.
    pub fn q_format(&self) -> Format {
        match self.inputs.q {
            Queries::E4m3(_) => Format::E4m3,
            Queries::E2m1 { .. } => Format::E2m1,
        }
    }

    /// Format of the keys.
    pub fn k_format(&self) -> Format {
        match self.inputs.k {
            Keys::E4m3 { .. } => Format::E4m3,
            Keys::E2m1 { .. } => Format::E2m1,
            Keys::Paged(pk) => pk.format,
        }
    }

    /// The paged keys, if the keys are paged.
    pub fn paged(&self) -> Option<&PagedKeys<'a>> {
        match &self.inputs.k {
            Keys::Paged(pk) => Some(pk),
            _ => None,
        }
    }

    /// Request-local key `j` of `row`'s request (`j < lc_b`), flat or paged.
    pub fn key(&self, row: &Row, j: usize) -> KeyRef<'a> {
        match self.inputs.k {
            Keys::E4m3 { codes, scale } => KeyRef::E4m3 {
                codes: codes.index_axis_move(Axis(0), row.ks + j),
                scale: scale[row.ks + j],
            },
            Keys::E2m1 { packed, scale } => KeyRef::E2m1 {
                packed: packed.index_axis_move(Axis(0), row.ks + j),
                scale: scale.index_axis_move(Axis(0), row.ks + j),
            },
            Keys::Paged(pk) => {
                let s = pk.slot(row.request, j);
                match pk.format {
                    Format::E4m3 => KeyRef::E4m3 {
                        codes: ArrayView1::from(pk.codes(s, self.dim)),
                        scale: pk.e4m3_scale(s, self.dim),
                    },
                    Format::E2m1 => KeyRef::E2m1 {
                        packed: ArrayView1::from(pk.codes(s, self.dim)),
                        scale: ArrayView1::from(pk.e2m1_scales(s, self.dim)),
                    },
                }
            }
        }
    }

    /// The keys laid out flat with their pool slots (paged problems; `None` when the
    /// keys are flat already). [`Problem::with_flat_keys`] makes the flat problem.
    pub fn gather_keys(&self) -> Option<crate::paged::FlatKeys> {
        self.paged().map(|pk| pk.gather(self.batch, self.dim))
    }

    /// This problem over `flat` (from [`Problem::gather_keys`]) instead of its pages:
    /// the same outputs, `page` included (its `k_slots` are the pool slots).
    pub fn with_flat_keys<'b>(&self, flat: &'b crate::paged::FlatKeys) -> Problem<'b>
    where
        'a: 'b,
    {
        // Problem is invariant in its lifetime (ndarray views are): reborrow each view.
        let q = match self.inputs.q {
            Queries::E4m3(v) => Queries::E4m3(v.reborrow()),
            Queries::E2m1 { packed, scale } => Queries::E2m1 {
                packed: packed.reborrow(),
                scale: scale.reborrow(),
            },
        };
        let role = match self.role {
            Role::Plain => Role::Plain,
            Role::Source { tail } => Role::Source { tail },
            Role::Consumer(c) => Role::Consumer(c),
        };
        Problem {
            batch: self.batch,
            inputs: Inputs {
                q,
                k: flat.keys(),
                weights: self.inputs.weights.reborrow(),
                k_slots: Some(flat.slots.view()),
            },
            heads: self.heads,
            dim: self.dim,
            topk: self.topk,
            page_cols: self.page_cols,
            block_size: self.block_size,
            num_blocks: self.num_blocks,
            role,
        }
    }

    /// Tail of a source layer.
    pub fn tail(&self) -> Option<usize> {
        match self.role {
            Role::Source { tail } => tail,
            _ => None,
        }
    }

    /// Whether row `i` publishes candidate blocks.
    pub fn publishes(&self, i: usize) -> bool {
        match self.role {
            Role::Source { tail } => {
                crate::batch::publishes(&self.batch.rows()[i], self.batch.requests(), tail)
            }
            _ => false,
        }
    }

    /// Pool slot of request-local key `j` of `row`'s request: `k_slots[ks + j]` (the
    /// identity by default), or the page table's slot for paged keys (SPEC 10).
    pub fn slot(&self, row: &Row, j: usize) -> i32 {
        if let Keys::Paged(pk) = &self.inputs.k {
            return pk.slot(row.request, j) as i32;
        }
        let x = row.ks + j;
        match self.inputs.k_slots {
            Some(s) => s[x],
            None => x as i32,
        }
    }
}

fn validate_consumer(batch: &Batch, p: &Published, params: Params) -> Result<()> {
    let mismatch = |field: String, value: String, expected: String| Error::CandidateMismatch {
        field,
        value,
        expected,
    };
    if p.block_size != params.block_size {
        return Err(mismatch(
            "block_size".into(),
            p.block_size.to_string(),
            params.block_size.to_string(),
        ));
    }
    if p.num_blocks() != params.num_blocks {
        return Err(mismatch(
            "width".into(),
            p.num_blocks().to_string(),
            params.num_blocks.to_string(),
        ));
    }
    if p.ratio != batch.ratio() {
        return Err(mismatch(
            "ratio".into(),
            p.ratio.to_string(),
            batch.ratio().to_string(),
        ));
    }
    if !p.blocks.is_standard_layout() {
        return Err(mismatch(
            "layout".into(),
            "not row-major".into(),
            "row-major [rows, NB] block ids".into(),
        ));
    }
    if p.rows.len() != batch.num_rows() || p.blocks.nrows() != batch.num_rows() {
        return Err(mismatch(
            "rows".into(),
            p.blocks.nrows().max(p.rows.len()).to_string(),
            batch.num_rows().to_string(),
        ));
    }
    for (i, (row, &(b, pos))) in batch.rows().iter().zip(&p.rows).enumerate() {
        if b != row.request {
            return Err(mismatch(
                format!("row[{i}].request"),
                b.to_string(),
                row.request.to_string(),
            ));
        }
        if pos != row.position {
            return Err(mismatch(
                format!("row[{i}].position"),
                pos.to_string(),
                row.position.to_string(),
            ));
        }
        let own = batch.requests()[b].seq_len;
        let theirs = p.seq_lens.get(b).copied();
        if theirs.map(|s| s / p.ratio) != Some(own / batch.ratio()) {
            return Err(mismatch(
                format!("row[{i}].keys"),
                theirs.map_or("none".into(), |s| (s / p.ratio).to_string()),
                (own / batch.ratio()).to_string(),
            ));
        }
        // Ids ascending, inside the row's visible blocks, then -1 padding.
        let nb = row.n.div_ceil(params.block_size);
        let mut prev: i64 = -1;
        let mut padding = false;
        for (c, &id) in p.blocks.row(i).iter().enumerate() {
            let bad = if id < 0 {
                padding = true;
                id != -1
            } else {
                padding || (id as i64) <= prev || (id as usize) >= nb
            };
            if bad {
                return Err(mismatch(
                    format!("blocks[{i}, {c}]"),
                    id.to_string(),
                    format!("ascending block ids < {nb}, then -1 padding"),
                ));
            }
            if id >= 0 {
                prev = id as i64;
            }
        }
    }
    Ok(())
}
