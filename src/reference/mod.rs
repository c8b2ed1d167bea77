//! The oracle: SPEC 4 to 6 as the formulas read, one row at a time, rayon across rows.
//!
//! Every other path (the chunked driver, the fast CPU engine, CUDA) is tested against
//! [`run`] and [`logits()`]. [`int8_path`] is no part of the oracle: it models a kernel's
//! arithmetic (the exact class on int8 tensor cores) and is tested against it.

pub mod candidates;
pub mod int8_path;
pub mod logits;
pub mod topk;

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use ndarray::Array2;
use rayon::prelude::*;

use crate::problem::{Problem, Published, Role};

pub use logits::row_logits;
pub use topk::rank_key;

/// Outputs of one layer-forward.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    /// Selected request-local key positions, sorted, `-1`-padded: `[T, K]`.
    pub raw: Array2<i32>,
    /// Their pool slots, `-1`-padded: `[T, page_cols]`.
    pub page: Array2<i32>,
    /// Source layers: the published candidate blocks.
    pub published: Option<Published>,
}

impl Output {
    /// Preallocated outputs for `p`, all `-1`: `raw`, `page`, and for a source the
    /// published rows (with their requests and positions filled in).
    pub fn alloc(p: &Problem) -> Output {
        let t = p.batch.num_rows();
        let published = match p.role {
            Role::Source { .. } => {
                let rows: Vec<(usize, usize)> = (0..t)
                    .filter(|&i| p.publishes(i))
                    .map(|i| (p.batch.rows()[i].request, p.batch.rows()[i].position))
                    .collect();
                Some(Published {
                    block_size: p.block_size,
                    ratio: p.batch.ratio(),
                    seq_lens: p.batch.seq_lens(),
                    blocks: Array2::from_elem((rows.len(), p.num_blocks), -1),
                    rows,
                })
            }
            _ => None,
        };
        Output {
            raw: Array2::from_elem((t, p.topk), -1),
            page: Array2::from_elem((t, p.page_cols), -1),
            published,
        }
    }
}

/// Per-worker scratch of the row epilogue: the top-k heap and ids, the block heap.
#[derive(Debug)]
pub struct RowScratch {
    topk: topk::Scratch,
    blocks: BinaryHeap<Reverse<u64>>,
}

impl RowScratch {
    /// Scratch for a problem's `K` and `NB`.
    pub fn new(p: &Problem) -> Self {
        let nb = if matches!(p.role, Role::Source { .. }) {
            p.num_blocks
        } else {
            0
        };
        RowScratch {
            topk: topk::Scratch::new(p.topk),
            blocks: BinaryHeap::with_capacity(nb),
        }
    }
}

/// Everything after the logits for row `i`: publish its kept blocks (source rows that
/// publish; `block_keys` holds `ceil(n / B)` entries of scratch), then select and
/// assemble `raw` and `page`.
#[allow(clippy::too_many_arguments)]
pub fn finish_row(
    p: &Problem,
    i: usize,
    scores: &[f32],
    block_keys: &mut [u32],
    published: Option<&mut [i32]>,
    raw: &mut [i32],
    page: &mut [i32],
    s: &mut RowScratch,
) {
    let row = p.batch.rows()[i];
    let n = row.n;
    if let Some(out) = published {
        candidates::block_keys(scores, n, p.block_size, block_keys);
        candidates::kept_blocks(block_keys, n, p.block_size, out, &mut s.blocks);
    }
    let ids = match p.role {
        Role::Consumer(c) => {
            let blocks = c.blocks.row(i);
            let blocks = blocks.as_slice().unwrap_or(&[]);
            topk::select(
                scores,
                candidates::consumer_candidates(blocks, n, p.block_size),
                p.topk,
                &mut s.topk,
            )
        }
        _ => topk::select(scores, 0..n, p.topk, &mut s.topk),
    };
    raw.iter_mut().for_each(|x| *x = -1);
    page.iter_mut().for_each(|x| *x = -1);
    for (c, &j) in ids.iter().enumerate() {
        raw[c] = j;
        page[c] = p.slot(&row, j as usize);
    }
}

/// All rows' logits over their visible keys, rows concatenated: `f32 [sum n]`
/// (the layout of the golden `expected_logits`).
pub fn logits(p: &Problem) -> Vec<f32> {
    let rows: Vec<Vec<f32>> = (0..p.batch.num_rows())
        .into_par_iter()
        .map(|i| {
            let mut v = vec![0f32; p.batch.rows()[i].n];
            row_logits(p, i, &mut v);
            v
        })
        .collect();
    rows.concat()
}

/// One row's outputs: its `raw` row, its `page` row, and its published blocks when
/// it publishes.
type RowOut = (Vec<i32>, Vec<i32>, Option<Vec<i32>>);

/// The whole layer-forward, untiled: every row's full logits, then its epilogue.
pub fn run(p: &Problem) -> Output {
    let mut out = Output::alloc(p);
    let pub_index: Vec<Option<usize>> = {
        let mut k = 0;
        (0..p.batch.num_rows())
            .map(|i| {
                p.publishes(i).then(|| {
                    k += 1;
                    k - 1
                })
            })
            .collect()
    };
    let per_row: Vec<RowOut> = (0..p.batch.num_rows())
        .into_par_iter()
        .map_init(
            || RowScratch::new(p),
            |s, i| {
                let n = p.batch.rows()[i].n;
                let mut scores = vec![0f32; n];
                row_logits(p, i, &mut scores);
                let mut raw = vec![-1; p.topk];
                let mut page = vec![-1; p.page_cols];
                let mut blocks = pub_index[i].map(|_| vec![-1; p.num_blocks]);
                let mut keys = vec![
                    0u32;
                    if blocks.is_some() {
                        n.div_ceil(p.block_size)
                    } else {
                        0
                    }
                ];
                finish_row(
                    p,
                    i,
                    &scores,
                    &mut keys,
                    blocks.as_deref_mut(),
                    &mut raw,
                    &mut page,
                    s,
                );
                (raw, page, blocks)
            },
        )
        .collect();
    for (i, (raw, page, blocks)) in per_row.into_iter().enumerate() {
        out.raw.row_mut(i).assign(&ndarray::ArrayView1::from(&raw));
        out.page
            .row_mut(i)
            .assign(&ndarray::ArrayView1::from(&page));
        if let (Some(b), Some(k), Some(pb)) = (blocks, pub_index[i], out.published.as_mut()) {
            pb.blocks.row_mut(k).assign(&ndarray::ArrayView1::from(&b));
        }
    }
    out
}
