//! The fuzzer's bytes as a case: [`Spec`], its fixed byte layout ([`Spec::to_bytes`]),
//! and the shape decisions taken from it (requests and rows, `H`, `D`, parameters,
//! tail, budgets, the defect it carries).

use arbitrary::Arbitrary;

use dsa_indexer::problem::Params;

use super::defect::{Defect, DEFECTS};
use crate::Rng;

/// The fuzzer's view of a case. Every field has a fixed size, so the byte layout is
/// simply the fields in order (integers and `f32` little-endian, `bool` and `Option`
/// tags one byte, low bit set = true), missing bytes read as zero, and
/// [`Spec::to_bytes`] writes seeds. Lengths and selectors are taken modulo their range.
#[derive(Arbitrary, Debug, Clone, Default, PartialEq)]
pub struct Spec {
    /// `corrupt % 64 >= 48` injects defect number `corrupt % 64 - 48` (0, the
    /// fuzzer's default for a short input, injects none).
    pub corrupt: u8,
    /// `r = 1 + ratio % 4`.
    pub ratio: u8,
    /// Requests used: `[2, 1, 3, 4, 0][n_requests % 5]`.
    pub n_requests: u8,
    /// `(seq_len, rows)` per request: `S = a % 41`, `E = b % (S + 1)`, `q0 = S - E`.
    pub requests: [(u8, u8); 4],
    /// Odd: explicit rows, drawn from `seed` (duplicates and any order).
    pub explicit: u8,
    /// Explicit rows: `n_explicit % 49`.
    pub n_explicit: u8,
    /// `H` selector (small values likelier).
    pub heads: u8,
    /// `D` selector.
    pub dim: u8,
    /// Queries in E2M1 (else E4M3).
    pub q_fp4: bool,
    /// Keys in E2M1 (else E4M3).
    pub k_fp4: bool,
    /// Query code bytes come from the first `len % 9` entries (all bytes when 0).
    pub q_palette: (u8, [u8; 8]),
    /// Key code bytes.
    pub k_palette: (u8, [u8; 8]),
    /// UE8M0 scale bytes (`110..=145` when empty; 255 becomes 254).
    pub scale_palette: (u8, [u8; 8]),
    /// Head weights (non-finite ones become 0.5; quarter-steps in [-2, 2] when empty).
    pub w_palette: (u8, [f32; 4]),
    /// Per-key scales (absolute value; non-finite or zero become 1).
    pub kscale_palette: (u8, [f32; 4]),
    /// Fills the tensors.
    pub seed: u64,
    /// Give `k_slots` (else the identity).
    pub slots: bool,
    /// `K = 1 + topk % 48`.
    pub topk: u8,
    /// `page_cols = K + extra` when present.
    pub page_extra: Option<u8>,
    /// `B = 1 + b % 9`.
    pub block_size: u8,
    /// `NB = 1 + nb % 6`.
    pub num_blocks: u8,
    /// `role % 3`: plain, source, consumer (of a source run on the same batch).
    pub role: u8,
    /// `tail = 1 + t % 40`.
    pub tail: Option<u8>,
    /// Two logits budgets in bytes (0, the fuzzer's default, means `usize::MAX`).
    pub budgets: [u16; 2],
    /// Rayon threads: `1 + threads % 3`.
    pub threads: u8,
}

/// Largest rows in a case, and the cost cap `sum n * H * D`.
pub const MAX_ROWS: usize = 48;
const MAX_COST: usize = 1 << 20;

/// Shape decisions of a case.
#[derive(Debug, Clone)]
pub struct Layout {
    /// `S_b`.
    pub seq_lens: Vec<usize>,
    /// `q0_b` (contiguous).
    pub query_starts: Vec<usize>,
    /// Explicit rows.
    pub explicit: Option<(Vec<usize>, Vec<usize>)>,
    /// `r` (0 under [`Defect::ZeroRatio`]).
    pub ratio: usize,
    /// `H`.
    pub heads: usize,
    /// `D`.
    pub dim: usize,
}

impl Spec {
    /// The bytes that decode to this spec (for seed corpora and regression files).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = vec![self.corrupt, self.ratio, self.n_requests];
        for &(x, y) in &self.requests {
            b.extend([x, y]);
        }
        b.extend([
            self.explicit,
            self.n_explicit,
            self.heads,
            self.dim,
            self.q_fp4 as u8,
            self.k_fp4 as u8,
        ]);
        for p in [&self.q_palette, &self.k_palette, &self.scale_palette] {
            b.push(p.0);
            b.extend(p.1);
        }
        for p in [&self.w_palette, &self.kscale_palette] {
            b.push(p.0);
            p.1.iter().for_each(|x| b.extend(x.to_le_bytes()));
        }
        b.extend(self.seed.to_le_bytes());
        b.extend([self.slots as u8, self.topk]);
        let opt = |b: &mut Vec<u8>, x: Option<u8>| match x {
            Some(v) => b.extend([1, v]),
            None => b.push(0),
        };
        opt(&mut b, self.page_extra);
        b.extend([self.block_size, self.num_blocks, self.role]);
        opt(&mut b, self.tail);
        self.budgets.iter().for_each(|x| b.extend(x.to_le_bytes()));
        b.push(self.threads);
        b
    }

    /// The defect this case carries, if any.
    pub fn defect(&self) -> Option<Defect> {
        ((self.corrupt % 64) as usize)
            .checked_sub(48)
            .and_then(|i| DEFECTS.get(i).copied())
    }

    /// Requests, rows, `H`, `D`.
    pub fn layout(&self) -> Layout {
        let ratio = 1 + (self.ratio % 4) as usize;
        let mut seq_lens = Vec::new();
        let mut query_starts = Vec::new();
        let mut rows = 0usize;
        let n = [2, 1, 3, 4, 0][(self.n_requests % 5) as usize];
        for &(a, b) in &self.requests[..n] {
            let s = (a % 41) as usize;
            let e = ((b as usize) % (s + 1)).min(MAX_ROWS - rows);
            rows += e;
            seq_lens.push(s);
            query_starts.push(s - e);
        }
        let live: Vec<usize> = (0..seq_lens.len()).filter(|&b| seq_lens[b] > 0).collect();
        let explicit: Option<(Vec<usize>, Vec<usize>)> =
            (self.explicit % 2 == 1 && !live.is_empty()).then(|| {
                let mut rng = Rng(self.seed ^ 0x5EED);
                (0..self.n_explicit as usize % (MAX_ROWS + 1))
                    .map(|_| {
                        let b = live[rng.below(live.len())];
                        (b, rng.below(seq_lens[b]))
                    })
                    .unzip()
            });
        let mut heads = [8, 8, 8, 8, 16, 16, 32, 64][(self.heads % 8) as usize];
        let mut dim = [32, 32, 64, 128][(self.dim % 4) as usize];
        // Bound the reference's work: sum n * H * D.
        let pairs: usize = match &explicit {
            Some((_, pos)) => pos.iter().map(|p| (p + 1) / ratio).sum(),
            None => seq_lens
                .iter()
                .zip(&query_starts)
                .map(|(&s, &q0)| (q0..s).map(|p| (p + 1) / ratio).sum::<usize>())
                .sum(),
        };
        while pairs * heads * dim > MAX_COST && heads > 8 {
            heads /= 2;
        }
        while pairs * heads * dim > MAX_COST && dim > 32 {
            dim /= 2;
        }
        Layout {
            seq_lens,
            query_starts,
            explicit,
            ratio,
            heads,
            dim,
        }
    }

    /// `K`, `page_cols`, `B`, `NB`.
    pub fn params(&self) -> Params {
        let topk = 1 + (self.topk % 48) as usize;
        Params {
            topk,
            page_cols: self.page_extra.map(|e| topk + e as usize),
            block_size: 1 + (self.block_size % 9) as usize,
            num_blocks: 1 + (self.num_blocks % 6) as usize,
        }
    }

    /// `tail`.
    pub fn tail(&self) -> Option<usize> {
        self.tail.map(|t| 1 + (t % 40) as usize)
    }

    /// The two budgets.
    pub fn budgets(&self) -> [usize; 2] {
        self.budgets
            .map(|b| if b == 0 { usize::MAX } else { b as usize })
    }
}
