//! The chunked driver (SPEC 7): plan -> for each tile (logits, candidate blocks, top-k,
//! index assembly) -> outputs written in place. Generic over a [`Backend`].
//!
//! Outputs (`raw [T, K]`, `page [T, page_cols]`, published `[P, NB]`) are allocated
//! once; each tile writes its rows into them. Nothing of size `rows x context`
//! outlives its tile, and no per-tile results are joined at the end.

use crate::error::{Error, Result};
use crate::plan::{self, Footprint, Plan, PlanParams, PlanRole};
use crate::problem::{Problem, Role};
use crate::reference::{self, Output, RowScratch};

/// A backend's footprint: its logits row padding, worker count and per-worker buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowFootprint {
    /// Row length in f32 is `n` rounded up to a multiple of this.
    pub align: usize,
    /// Rows processed concurrently.
    pub workers: usize,
    /// Operand bytes per worker.
    pub worker_bytes: usize,
    /// Tiles whose logits the backend keeps at once ([`Footprint::logits_slots`]; 0 is
    /// taken as 1).
    pub logits_slots: usize,
}

impl Footprint for RowFootprint {
    fn row_bytes(&self, n: usize) -> usize {
        n.div_ceil(self.align.max(1))
            .saturating_mul(self.align.max(1))
            .saturating_mul(4)
    }
    fn workers(&self) -> usize {
        self.workers
    }
    fn worker_bytes(&self) -> usize {
        self.worker_bytes
    }
    fn logits_slots(&self) -> usize {
        self.logits_slots.max(1)
    }
}

/// What the driver needs of an engine.
pub trait Backend {
    /// Short name (`cpu`, `cuda`).
    fn name(&self) -> &'static str;
    /// Largest `K` the backend supports.
    fn max_topk(&self) -> usize;
    /// Footprint model for problem `p` (the planner's input).
    fn footprint(&self, p: &Problem) -> RowFootprint;
    /// Allocate the run's buffers, sized by the plan.
    fn begin(&mut self, p: &Problem, plan: &Plan) -> Result<()>;
    /// Compute tile `t` of the plan and write its rows of `out`.
    fn tile(&mut self, p: &Problem, plan: &Plan, t: usize, out: &mut Output) -> Result<()>;
    /// Finish the run (copy back what the backend kept) and release its buffers.
    fn end(&mut self, p: &Problem, out: &mut Output) -> Result<()>;
    /// Transient device bytes the last run allocated, for backends that count them
    /// (checked against the plan's peak); `None` for host backends.
    fn device_peak(&self) -> Option<usize> {
        None
    }
}

/// The plan parameters of problem `p` under `budget`.
pub fn plan_params(p: &Problem, budget: usize) -> PlanParams {
    PlanParams {
        heads: p.heads,
        dim: p.dim,
        topk: p.topk,
        block_size: p.block_size,
        num_blocks: p.num_blocks,
        role: match p.role {
            Role::Plain => PlanRole::Plain,
            Role::Source { tail } => PlanRole::Source { tail },
            Role::Consumer(_) => PlanRole::Consumer,
        },
        budget,
    }
}

/// Plan problem `p` for backend `b` under a logits budget in bytes.
pub fn plan_for<B: Backend + ?Sized>(b: &B, p: &Problem, budget: usize) -> Result<Plan> {
    if p.topk > b.max_topk() {
        return Err(Error::range(
            "topk",
            p.topk,
            "at most the backend's largest K",
        ));
    }
    plan::plan(p.batch, &plan_params(p, budget), &b.footprint(p))
}

/// Run problem `p` on backend `b` in tiles whose logits fit `budget` bytes.
pub fn run<B: Backend + ?Sized>(b: &mut B, p: &Problem, budget: usize) -> Result<(Output, Plan)> {
    run_observed(b, p, budget, |_| {})
}

/// What the driver tells an observer of [`run_observed`] as a run goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TileEvent {
    /// The plan is made; `tiles` tiles follow.
    Planned {
        /// Tiles of the plan.
        tiles: usize,
    },
    /// Tile `tile` of `tiles` has written its rows.
    Done {
        /// The tile's index in the plan.
        tile: usize,
        /// Tiles of the plan.
        tiles: usize,
        /// The rows it wrote.
        rows: std::ops::Range<usize>,
    },
}

/// [`run`], calling `observe` once the plan is made and after each tile (for a
/// progress bar); the outputs do not depend on it.
pub fn run_observed<B: Backend + ?Sized>(
    b: &mut B,
    p: &Problem,
    budget: usize,
    mut observe: impl FnMut(TileEvent),
) -> Result<(Output, Plan)> {
    let plan = plan_for(b, p, budget)?;
    let tiles = plan.tiles.len();
    observe(TileEvent::Planned { tiles });
    let mut out = Output::alloc(p);
    b.begin(p, &plan)?;
    for (t, tile) in plan.tiles.iter().enumerate() {
        if let Err(e) = b.tile(p, &plan, t, &mut out) {
            let _ = b.end(p, &mut out);
            return Err(e);
        }
        observe(TileEvent::Done {
            tile: t,
            tiles,
            rows: tile.rows.clone(),
        });
    }
    b.end(p, &mut out)?;
    Ok((out, plan))
}

/// The rows of `out` that tile `tile` writes: `raw`, `page` and published blocks, as
/// row-major slices. Errors if `out` does not have `p`'s shapes in standard layout.
pub fn tile_outputs<'o>(
    p: &Problem,
    tile: &crate::plan::Tile,
    out: &'o mut Output,
) -> Result<(&'o mut [i32], &'o mut [i32], &'o mut [i32])> {
    let (t, k, pc, nb) = (p.batch.num_rows(), p.topk, p.page_cols, p.num_blocks);
    let bad = |field: &str, shape: &[usize], want: &[usize]| {
        Error::shape(format!("{field} (standard layout)"), shape, want)
    };
    let pub_rows = (0..t).filter(|&i| p.publishes(i)).count();
    if tile.rows.end > t || tile.published.end > pub_rows {
        return Err(Error::range(
            "tile.rows",
            format!("{:?}", tile.rows),
            "rows of this problem",
        ));
    }
    // Checked without allocating: this runs once per tile inside the measured peak.
    let ok =
        |a: &ndarray::Array2<i32>, want: [usize; 2]| a.shape() == want && a.is_standard_layout();
    if !ok(&out.raw, [t, k]) {
        return Err(bad("raw", out.raw.shape(), &[t, k]));
    }
    if !ok(&out.page, [t, pc]) {
        return Err(bad("page", out.page.shape(), &[t, pc]));
    }
    let source = matches!(p.role, crate::problem::Role::Source { .. });
    if source {
        match &out.published {
            Some(pb) if ok(&pb.blocks, [pub_rows, nb]) => {}
            Some(pb) => return Err(bad("published", pb.blocks.shape(), &[pub_rows, nb])),
            None => return Err(Error::shape("published", &[], &[pub_rows, nb])),
        }
    }
    let layout = || Error::shape("output (standard layout)", &[], &[]);
    let raw = out.raw.as_slice_mut().ok_or_else(layout)?;
    let page = out.page.as_slice_mut().ok_or_else(layout)?;
    let published: &mut [i32] = match out.published.as_mut() {
        Some(pb) if source => &mut pb.blocks.as_slice_mut().ok_or_else(layout)?
            [tile.published.start * nb..tile.published.end * nb],
        _ => &mut [],
    };
    Ok((
        &mut raw[tile.rows.start * k..tile.rows.end * k],
        &mut page[tile.rows.start * pc..tile.rows.end * pc],
        published,
    ))
}

/// One CPU worker's buffers: the logits engine and the row epilogue.
#[derive(Debug)]
struct Worker {
    engine: crate::cpu::Engine,
    rows: RowScratch,
}

/// The CPU backend: the fast engine, bitwise equal to the reference, rayon across rows.
#[derive(Debug, Default)]
pub struct CpuBackend {
    logits: Vec<f32>,
    block_keys: Vec<u32>,
    workers: Vec<Worker>,
}

impl CpuBackend {
    /// On the current rayon pool.
    pub fn new() -> Self {
        CpuBackend::default()
    }

    fn threads(&self) -> usize {
        rayon::current_num_threads().max(1)
    }
}

/// Logits row length of the CPU backend: `n` rounded up to 4 floats.
pub const CPU_ROW_ALIGN: usize = 4;

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }
    fn max_topk(&self) -> usize {
        crate::problem::MAX_TOPK
    }
    fn footprint(&self, p: &Problem) -> RowFootprint {
        RowFootprint {
            align: CPU_ROW_ALIGN,
            workers: self.threads(),
            // The engine's buffers, plus the worker record itself (kept in a Vec).
            worker_bytes: crate::cpu::Engine::bytes(p.heads, p.dim, p.class())
                + std::mem::size_of::<Worker>(),
            logits_slots: 1,
        }
    }
    fn begin(&mut self, p: &Problem, plan: &Plan) -> Result<()> {
        self.logits = Vec::new();
        self.logits
            .try_reserve_exact(plan.peak.logits_tile / 4)
            .map_err(|_| Error::overflow("logits tile"))?;
        self.logits.resize(plan.peak.logits_tile / 4, 0.0);
        self.block_keys = vec![0; plan.peak.block_scores / 4];
        self.workers = (0..plan.workers)
            .map(|_| Worker {
                engine: crate::cpu::Engine::new(p),
                rows: RowScratch::new(p),
            })
            .collect();
        Ok(())
    }
    fn tile(&mut self, p: &Problem, plan: &Plan, t: usize, out: &mut Output) -> Result<()> {
        let tile = plan
            .tiles
            .get(t)
            .ok_or_else(|| Error::range("tile", t, "an index into the plan's tiles"))?;
        let fp = self.footprint(p);
        if self.logits.len() * 4 < tile.logits_bytes
            || self.block_keys.len() * 4 < tile.block_score_bytes
        {
            return Err(Error::range(
                "tile",
                t,
                "a tile of the plan passed to begin()",
            ));
        }
        let (raw, page, published) = tile_outputs(p, tile, out)?;
        let ctx = Ctx { p, fp };
        ctx.split(
            tile.rows.clone(),
            &mut self.logits[..tile.logits_bytes / 4],
            &mut self.block_keys[..tile.block_score_bytes / 4],
            raw,
            page,
            published,
            &mut self.workers,
        );
        Ok(())
    }
    fn end(&mut self, _p: &Problem, _out: &mut Output) -> Result<()> {
        self.logits = Vec::new();
        self.block_keys = Vec::new();
        self.workers = Vec::new();
        Ok(())
    }
}

struct Ctx<'p, 'a> {
    p: &'p Problem<'a>,
    fp: RowFootprint,
}

impl Ctx<'_, '_> {
    fn row_floats(&self, i: usize) -> usize {
        self.fp.row_bytes(self.p.batch.rows()[i].n) / 4
    }
    fn row_blocks(&self, i: usize) -> usize {
        if self.p.publishes(i) {
            self.p.batch.rows()[i].n.div_ceil(self.p.block_size)
        } else {
            0
        }
    }

    /// Split rows and buffers between workers (recursively, no allocation), then run
    /// each worker's rows in order.
    #[allow(clippy::too_many_arguments)]
    fn split(
        &self,
        rows: std::ops::Range<usize>,
        logits: &mut [f32],
        keys: &mut [u32],
        raw: &mut [i32],
        page: &mut [i32],
        published: &mut [i32],
        ws: &mut [Worker],
    ) {
        if ws.len() <= 1 || rows.len() <= 1 {
            if let Some(w) = ws.first_mut() {
                self.serial(rows, logits, keys, raw, page, published, w);
            }
            return;
        }
        // Split the work (visible keys) in proportion to the workers on each side.
        let work = |i: usize| self.p.batch.rows()[i].n as u128 + 1;
        let total: u128 = rows.clone().map(work).sum();
        let half = ws.len() / 2;
        let target = total * half as u128 / ws.len() as u128;
        let (mut acc, mut mid) = (0u128, rows.start);
        while mid < rows.end - 1 && acc + work(mid) <= target {
            acc += work(mid);
            mid += 1;
        }
        let mid = mid.max(rows.start + 1);
        let lf: usize = (rows.start..mid).map(|i| self.row_floats(i)).sum();
        let lk: usize = (rows.start..mid).map(|i| self.row_blocks(i)).sum();
        let lp = (rows.start..mid).filter(|&i| self.p.publishes(i)).count() * self.p.num_blocks;
        let nr = mid - rows.start;
        let (l0, l1) = logits.split_at_mut(lf);
        let (k0, k1) = keys.split_at_mut(lk);
        let (r0, r1) = raw.split_at_mut(nr * self.p.topk);
        let (g0, g1) = page.split_at_mut(nr * self.p.page_cols);
        let (p0, p1) = published.split_at_mut(lp);
        let (w0, w1) = ws.split_at_mut(half);
        rayon::join(
            || self.split(rows.start..mid, l0, k0, r0, g0, p0, w0),
            || self.split(mid..rows.end, l1, k1, r1, g1, p1, w1),
        );
    }

    #[allow(clippy::too_many_arguments)]
    fn serial(
        &self,
        rows: std::ops::Range<usize>,
        mut logits: &mut [f32],
        mut keys: &mut [u32],
        mut raw: &mut [i32],
        mut page: &mut [i32],
        mut published: &mut [i32],
        w: &mut Worker,
    ) {
        let p = self.p;
        let mut i = rows.start;
        while i < rows.end {
            let g = (rows.end - i).min(crate::cpu::ROW_GROUP);
            let idx: [usize; crate::cpu::ROW_GROUP] = std::array::from_fn(|r| i + r.min(g - 1));
            // Carve the group's logits rows out of the tile buffer.
            let mut outs: [&mut [f32]; crate::cpu::ROW_GROUP] = Default::default();
            let mut rest = std::mem::take(&mut logits);
            for (r, o) in outs.iter_mut().enumerate().take(g) {
                let (a, b) = rest.split_at_mut(self.row_floats(i + r));
                *o = a;
                rest = b;
            }
            logits = rest;
            w.engine.rows(p, &idx[..g], &mut outs[..g]);
            for (r, scores) in outs.iter().enumerate().take(g) {
                let row = i + r;
                let n = p.batch.rows()[row].n;
                let (rw, rr) = std::mem::take(&mut raw).split_at_mut(p.topk);
                raw = rr;
                let (pg, pr) = std::mem::take(&mut page).split_at_mut(p.page_cols);
                page = pr;
                let (kb, kr) = std::mem::take(&mut keys).split_at_mut(self.row_blocks(row));
                keys = kr;
                let pubrow = if p.publishes(row) {
                    let (a, b) = std::mem::take(&mut published).split_at_mut(p.num_blocks);
                    published = b;
                    Some(a)
                } else {
                    None
                };
                reference::finish_row(p, row, &scores[..n], kb, pubrow, rw, pg, &mut w.rows);
            }
            i += g;
        }
    }
}

/// Run on the CPU with the default pool.
pub fn run_cpu(p: &Problem, budget: usize) -> Result<(Output, Plan)> {
    run(&mut CpuBackend::new(), p, budget)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::Batch;
    use crate::problem::{Inputs, Keys, Params, Queries};
    use ndarray::{Array1, Array2, Array3};

    #[test]
    fn the_observer_sees_the_plan_and_every_tile_in_order() {
        let batch = Batch::contiguous(&[64, 48], &[0, 16], 1).unwrap();
        let (t, l) = (batch.num_rows(), batch.num_keys());
        let q = Array3::from_shape_fn((t, 8, 32), |(i, h, d)| ((i * 7 + h * 3 + d) % 0x70) as u8);
        let k = Array2::from_shape_fn((l, 32), |(j, d)| ((j * 5 + d * 11) % 0x70) as u8);
        let ks = Array1::from_elem(l, 1.0f32);
        let w = Array2::from_elem((t, 8), 0.5f32);
        let inputs = Inputs {
            q: Queries::E4m3(q.view()),
            k: Keys::E4m3 {
                codes: k.view(),
                scale: ks.view(),
            },
            weights: w.view(),
            k_slots: None,
        };
        let p = Problem::new(&batch, inputs, Params::new(8), Role::Plain).unwrap();
        // A budget of a few rows: many tiles.
        let budget = 1024;
        let mut events = Vec::new();
        let (out, plan) =
            run_observed(&mut CpuBackend::new(), &p, budget, |e| events.push(e)).unwrap();
        let tiles = plan.tiles.len();
        assert!(tiles > 8, "{tiles} tiles");
        assert_eq!(events.len(), tiles + 1);
        assert_eq!(events[0], TileEvent::Planned { tiles });
        for (i, e) in events[1..].iter().enumerate() {
            let rows = plan.tiles[i].rows.clone();
            assert_eq!(
                *e,
                TileEvent::Done {
                    tile: i,
                    tiles,
                    rows
                }
            );
        }
        let (plain, _) = run(&mut CpuBackend::new(), &p, budget).unwrap();
        assert_eq!(out, plain);
        assert_eq!(out, crate::reference::run(&p));
    }
}
