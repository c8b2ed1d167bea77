//! The row-tile planner (SPEC 7): a pure function from the batch, the layer and a
//! backend's footprint model to row tiles and a peak-transient figure, term by term.
//!
//! Peak transient of a run (bytes above inputs and outputs):
//!
//! ```text
//! peak = logits_tile                      slots * max over tiles of sum_rows footprint(n)   <= budget*
//!      + block_scores                     max over tiles of sum_publishing_rows ceil(n/B) * 4
//!      + candidate_ids                    workers * NB * 8        (source layers)
//!      + topk_scratch                     workers * K * 8
//!      + index_assembly                   workers * K * 4
//!      + operands                         workers * (decoded query rows and key: H, D only)
//! ```
//!
//! (*) unless one row alone exceeds the budget; that row is then a tile of its own and
//! the plan says so. Only the first two terms depend on the context length, and both are
//! capped by the tile, hence by the budget: block scores are at most `1/B` of the
//! tile's logits. The others depend on `K`, `NB` and the worker count only.
//!
//! A backend that keeps two tiles' logits in flight (the CUDA backend selecting one
//! tile while it computes the next: [`Footprint::logits_slots`]) gets tiles of at most
//! half the budget each, so that both slots together stay within it, and of at most a
//! [`PIPELINE_TILES`]th of the batch's logits plus its widest row, so that a batch that
//! fits one tile still overlaps, in at most that many tiles. It keeps one slot when that
//! would leave a single tile or a row alone over half the budget ([`Plan::logits_slots`]
//! says which). `slots` above is that figure.

use std::ops::Range;

use crate::batch::Batch;
use crate::error::{Error, Result};

/// What the planner needs to know about a backend.
pub trait Footprint {
    /// Bytes of logits the backend stores for a row with `n` visible keys.
    fn row_bytes(&self, n: usize) -> usize;
    /// Rows processed concurrently, each with its own epilogue scratch.
    fn workers(&self) -> usize;
    /// Bytes of operand buffers each worker holds (decoded rows and keys).
    fn worker_bytes(&self) -> usize {
        0
    }
    /// Tiles whose logits the backend keeps at once (1 or 2): with 2, tile `t + 1`'s
    /// logits are computed while tile `t` is selected from, each tile in its own slot.
    fn logits_slots(&self) -> usize {
        1
    }
}

/// The layer role as the planner sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlanRole {
    /// Top-k only.
    Plain,
    /// Publishes blocks for rows at positions `>= S_b - tail` (all rows when `None`).
    Source {
        /// Tail, `>= 1`.
        tail: Option<usize>,
    },
    /// Restricted to given blocks (inputs: no extra transient).
    Consumer,
}

/// Layer parameters the plan depends on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanParams {
    /// `H` (informational: the CPU footprint does not depend on it).
    pub heads: usize,
    /// `D`.
    pub dim: usize,
    /// `K`.
    pub topk: usize,
    /// `B`.
    pub block_size: usize,
    /// `NB`.
    pub num_blocks: usize,
    /// Role.
    pub role: PlanRole,
    /// Byte budget of the logits tile (`> 0`).
    pub budget: usize,
}

/// Tiles a two-slot plan cuts a batch into when half the budget does not bind
/// ([`Footprint::logits_slots`]): with each tile's selection beside the next tile's
/// logits, the first tile's logits and the last tile's selection are what stay exposed,
/// about a quarter of either at four tiles.
pub const PIPELINE_TILES: usize = 4;

/// Default logits budget: 2 GiB.
pub const DEFAULT_BUDGET: usize = 2 << 30;

/// One tile: a run of consecutive rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tile {
    /// Rows `[start, end)`.
    pub rows: Range<usize>,
    /// Published-row indices `[start, end)` of the tile's publishing rows.
    pub published: Range<usize>,
    /// Logits bytes of the tile.
    pub logits_bytes: usize,
    /// Block-score bytes of the tile.
    pub block_score_bytes: usize,
    /// A single row whose logits alone exceed the budget.
    pub oversized: bool,
}

/// Peak transient, term by term (bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Peak {
    /// The logits tile buffer: [`Plan::logits_slots`] slots of the largest tile.
    pub logits_tile: usize,
    /// Block scores of the tile's publishing rows.
    pub block_scores: usize,
    /// Kept-block selection heaps.
    pub candidate_ids: usize,
    /// Top-k heaps.
    pub topk_scratch: usize,
    /// Sorted selected ids before `raw`/`page` are written.
    pub index_assembly: usize,
    /// The backend's per-worker operand buffers.
    pub operands: usize,
}

impl Peak {
    /// Sum of the terms.
    pub fn total(&self) -> usize {
        self.logits_tile
            .saturating_add(self.block_scores)
            .saturating_add(self.candidate_ids)
            .saturating_add(self.topk_scratch)
            .saturating_add(self.index_assembly)
            .saturating_add(self.operands)
    }
}

/// A plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Tiles covering every row once, in order.
    pub tiles: Vec<Tile>,
    /// Tiles whose logits are held at once: 1, or 2 when the backend asks for two
    /// ([`Footprint::logits_slots`]) and the tiles planned to at most half the budget
    /// and a [`PIPELINE_TILES`]th of the batch's logits plus its widest row are at least
    /// two, none over half the budget. Tile `t` uses slot `t % logits_slots`.
    pub logits_slots: usize,
    /// Peak transient.
    pub peak: Peak,
    /// Workers the scratch terms were sized for.
    pub workers: usize,
    /// Rows in the largest tile.
    pub max_tile_rows: usize,
    /// Published rows.
    pub published_rows: usize,
    /// The unbounded engine's transient (SPEC 7): 6 bytes per (row, key) of each request.
    pub unbounded_bytes: u128,
}

impl Plan {
    /// Whether some row alone exceeds the budget.
    pub fn has_oversized_row(&self) -> bool {
        self.tiles.iter().any(|t| t.oversized)
    }
}

/// The seed engine's transient: fp32 logits `[E_b, lc_b]`, a bool mask of the same
/// shape and its concatenation copy, i.e. 6 bytes per (row, key), summed per request.
pub fn unbounded_bytes(batch: &Batch) -> u128 {
    let mut rows_per_req = vec![0u128; batch.requests().len()];
    for r in batch.rows() {
        rows_per_req[r.request] += 1;
    }
    batch
        .requests()
        .iter()
        .zip(rows_per_req)
        .map(|(q, e)| 6 * e * q.keys as u128)
        .sum()
}

/// Plan the tiles of `batch` under `params`, for a backend with footprint `fp`.
pub fn plan(batch: &Batch, params: &PlanParams, fp: &dyn Footprint) -> Result<Plan> {
    if params.budget == 0 {
        return Err(Error::range("budget", 0, "budget > 0 bytes"));
    }
    if params.block_size == 0 {
        return Err(Error::range("block_size", 0, "block_size >= 1"));
    }
    let tail = match params.role {
        PlanRole::Source { tail: Some(0) } => return Err(Error::range("tail", 0, "tail >= 1")),
        PlanRole::Source { tail } => Some(tail),
        _ => None,
    };
    let publishes = |i: usize| match tail {
        None => false,
        Some(t) => crate::batch::publishes(&batch.rows()[i], batch.requests(), t),
    };
    let b = params.block_size;
    let half = params.budget / 2;
    // Two slots: tiles of at most half the budget and about a PIPELINE_TILES-th of the
    // logits, kept when there are two or more and every one fits half the budget (then
    // none is over the whole).
    let two = (fp.logits_slots() >= 2)
        .then(|| {
            let (total, widest) = batch.rows().iter().fold((0usize, 0usize), |(t, w), r| {
                let rb = fp.row_bytes(r.n);
                (t.saturating_add(rb), w.max(rb))
            });
            // A greedy tile closes only when the next row would pass the cap, so every
            // tile but the last holds more than `cap - widest`: with the widest row added
            // to a PIPELINE_TILES-th, no batch gets more than PIPELINE_TILES tiles (no
            // straggler tile of a few rows).
            let cap = half
                .min(total.div_ceil(PIPELINE_TILES).saturating_add(widest))
                .max(1);
            tiles(batch, cap, fp, &publishes, b)
        })
        .filter(|(t, _)| t.len() >= 2 && t.iter().all(|t| t.logits_bytes <= half));
    // A kept two-slot tile is never oversized: the cap is half the budget, which every
    // kept tile fits, or at least the widest row.
    let (tiles, pub_n, slots) = match two {
        Some((t, p)) => (t, p, 2),
        None => {
            let (t, p) = tiles(batch, params.budget, fp, &publishes, b);
            (t, p, 1)
        }
    };
    let max_tile_rows = tiles.iter().map(|t| t.rows.len()).max().unwrap_or(0);
    // No rows, no workers: an empty batch has no transient at all.
    let workers = fp.workers().max(1).min(max_tile_rows);
    let source = matches!(params.role, PlanRole::Source { .. });
    let peak = Peak {
        logits_tile: tiles
            .iter()
            .map(|t| t.logits_bytes)
            .max()
            .unwrap_or(0)
            .saturating_mul(slots),
        block_scores: tiles.iter().map(|t| t.block_score_bytes).max().unwrap_or(0),
        candidate_ids: if source {
            workers.saturating_mul(params.num_blocks).saturating_mul(8)
        } else {
            0
        },
        topk_scratch: workers.saturating_mul(params.topk).saturating_mul(8),
        index_assembly: workers.saturating_mul(params.topk).saturating_mul(4),
        operands: workers.saturating_mul(fp.worker_bytes()),
    };
    Ok(Plan {
        tiles,
        logits_slots: slots,
        peak,
        workers,
        max_tile_rows,
        published_rows: pub_n,
        unbounded_bytes: unbounded_bytes(batch),
    })
}

/// The greedy tiles of `batch`'s rows, each at most `budget` bytes of logits unless a row
/// alone exceeds it, and the number of publishing rows (`publishes`; blocks of
/// `block_size` keys).
fn tiles(
    batch: &Batch,
    budget: usize,
    fp: &dyn Footprint,
    publishes: &dyn Fn(usize) -> bool,
    block_size: usize,
) -> (Vec<Tile>, usize) {
    let mut tiles: Vec<Tile> = Vec::new();
    let mut cur = Tile {
        rows: 0..0,
        published: 0..0,
        logits_bytes: 0,
        block_score_bytes: 0,
        oversized: false,
    };
    for (i, row) in batch.rows().iter().enumerate() {
        let rb = fp.row_bytes(row.n);
        if !cur.rows.is_empty() && cur.logits_bytes.saturating_add(rb) > budget {
            let next = Tile {
                rows: i..i,
                published: cur.published.end..cur.published.end,
                logits_bytes: 0,
                block_score_bytes: 0,
                oversized: false,
            };
            tiles.push(std::mem::replace(&mut cur, next));
        }
        cur.rows.end = i + 1;
        cur.logits_bytes = cur.logits_bytes.saturating_add(rb);
        cur.oversized = cur.logits_bytes > budget;
        if publishes(i) {
            cur.published.end += 1;
            cur.block_score_bytes = cur
                .block_score_bytes
                .saturating_add(row.n.div_ceil(block_size).saturating_mul(4));
        }
    }
    let pub_n = cur.published.end;
    if !cur.rows.is_empty() {
        tiles.push(cur);
    }
    (tiles, pub_n)
}
