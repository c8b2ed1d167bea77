//! The CUDA backend for host inputs ([`CudaBackend`]): the chunked driver's
//! [`Backend`], which uploads the inputs once per run and copies the outputs back once,
//! in [`Backend::end`].

use std::sync::Arc;

use cudarc::driver::CudaSlice;

use super::alloc::{Buf, Fill, Space};
use super::device::{backend_err, drv, Device};
use super::geometry::{batch_footprint, check_shape, run_footprint, Paging, Shape, MAX_TOPK};
use super::kernels::{self, Precision, SelectStream};
use super::paths::{FoldCounts, TopkPaths};
use super::run::{OutPlace, Run, Uploads};
use crate::error::{Error, Result};
use crate::indexer::{Backend, RowFootprint};
use crate::plan::{Footprint, Plan};
use crate::problem::{Keys, Problem, Queries, Role};
use crate::reference::Output;

/// The CUDA backend for host inputs: uploads them once per run, keeps the outputs on
/// the device until [`Backend::end`].
pub struct CudaBackend {
    pub(super) dev: Arc<Device>,
    pub(super) run: Option<Run>,
    pub(super) peak: usize,
    paths: TopkPaths,
    folds: FoldCounts,
    precision: Precision,
    select: Option<SelectStream>,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("device", &self.dev.name())
            .field("peak", &self.peak)
            .field("precision", &self.precision)
            .finish()
    }
}

impl CudaBackend {
    /// On the process's shared device 0.
    pub fn new() -> Result<Self> {
        Ok(CudaBackend::on(Device::shared()?))
    }

    /// On a new handle of device 0 whose kernels are compiled and chosen under test
    /// hooks `hooks` ([`Device::with_hooks`]).
    pub fn with_hooks(hooks: kernels::Hooks) -> Result<Self> {
        Ok(CudaBackend::on(Device::with_hooks(hooks)?))
    }

    /// On a given device.
    pub fn on(dev: Arc<Device>) -> Self {
        CudaBackend {
            dev,
            run: None,
            peak: 0,
            paths: TopkPaths::default(),
            folds: FoldCounts::default(),
            precision: Precision::Full,
            select: kernels::select_stream(),
        }
    }

    /// This backend with the tolerance class's logits under `precision`
    /// ([`Precision::Fast`]: E4M3 x E4M3 at `H = 64` on fp8 `wgmma`, held to
    /// [`crate::cuda::fast_logit_bound`]; the default is [`Precision::Full`]).
    pub fn with_precision(mut self, precision: Precision) -> Self {
        self.precision = precision;
        self
    }

    /// The precision the tolerance class's logits run under.
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// This backend with each tile's selection on a stream of its own, at `priority`,
    /// beside the next tile's logits (`None`: one stream). The plan then holds two logits
    /// slots of tiles of at most half the budget ([`crate::plan::Plan::logits_slots`]);
    /// the outputs are the same bits. Opt-in and experimental: the default is `None`, or
    /// with the `tuning` feature the `SELECT_STREAM` define ([`kernels::select_stream`]).
    pub fn with_select_stream(mut self, priority: Option<SelectStream>) -> Self {
        self.select = priority;
        self
    }

    /// The selection's own stream's priority, if it has one.
    pub fn select_stream(&self) -> Option<SelectStream> {
        self.select
    }

    /// The device.
    pub fn device(&self) -> &Arc<Device> {
        &self.dev
    }

    /// Transient device bytes of the last run (metadata, logits tile, block keys, split
    /// top-k scratch, path counters), counted by `Device::allocate` as it allocated
    /// them.
    pub fn measured_peak(&self) -> usize {
        self.peak
    }

    /// How many row selections each top-k path made in the last run that ended.
    pub fn topk_paths(&self) -> TopkPaths {
        self.paths
    }

    /// What the exact-class logits kernels did in the last run that ended.
    pub fn fold_counts(&self) -> FoldCounts {
        self.folds
    }

    /// Every row's logits over its visible keys, rows concatenated (the layout of
    /// [`crate::reference::logits()`]), computed tile by tile under `budget` exactly as a
    /// run computes them. For tests and tools: it copies each tile's logits back.
    pub fn logits(&mut self, p: &Problem, budget: usize) -> Result<Vec<f32>> {
        let plan = crate::indexer::plan_for(self, p, budget)?;
        self.begin(p, &plan)?;
        let mut out = Vec::with_capacity(p.batch.valid_pairs());
        let fp = batch_footprint(p.batch, p.topk, self.dev.sm_count());
        for t in 0..plan.tiles.len() {
            let run = self.run.as_mut().ok_or_else(|| backend_err("no run"))?;
            run.tile(&self.dev, t)?;
            let mut off = run.logits_slot_base(t);
            let Some(l) = run.logits.as_ref().and_then(Buf::owned) else {
                continue;
            };
            let all = self
                .dev
                .stream
                .clone_dtoh(l)
                .map_err(drv("copy logits back"))?;
            for i in plan.tiles[t].rows.clone() {
                let n = p.batch.rows()[i].n;
                out.extend_from_slice(&all[off..off + n]);
                off += fp.row_bytes(n) / 4;
            }
        }
        self.run = None;
        Ok(out)
    }

    /// Candidate blocks, top-k and index assembly on the device from given scores
    /// (each row's `n` scores, rows concatenated, as [`crate::reference::logits()`]
    /// returns them): the selection half of a run, for tests that feed it the CPU's
    /// logits.
    pub fn select_scores(&mut self, p: &Problem, scores: &[f32], budget: usize) -> Result<Output> {
        if scores.len() != p.batch.valid_pairs() {
            return Err(Error::shape(
                "scores",
                &[scores.len()],
                &[p.batch.valid_pairs()],
            ));
        }
        let plan = crate::indexer::plan_for(self, p, budget)?;
        let mut out = Output::alloc(p);
        self.begin(p, &plan)?;
        let fp = batch_footprint(p.batch, p.topk, self.dev.sm_count());
        let mut src = 0usize;
        for t in 0..plan.tiles.len() {
            let run = self.run.as_mut().ok_or_else(|| backend_err("no run"))?;
            let mut off = run.logits_slot_base(t);
            if let Some(l) = run.logits.as_mut().and_then(Buf::owned_mut) {
                let mut host = vec![0f32; l.len()];
                for i in plan.tiles[t].rows.clone() {
                    let n = p.batch.rows()[i].n;
                    host[off..off + n].copy_from_slice(&scores[src..src + n]);
                    src += n;
                    off += fp.row_bytes(n) / 4;
                }
                self.dev
                    .stream
                    .memcpy_htod(&host, l)
                    .map_err(drv("upload scores"))?;
            }
            run.select_step(&self.dev, t)?;
        }
        self.end(p, &mut out)?;
        Ok(out)
    }
}

impl CudaBackend {
    /// [`Backend::begin`] on flat keys, or on paged keys whose pages the kernels read
    /// (`paging`: [`paging_of`]).
    fn begin_inputs(&mut self, p: &Problem, plan: &Plan, paging: Option<Paging>) -> Result<()> {
        let shape = Shape {
            paged: paging,
            ..shape_of(p, self.precision, self.select)
        };
        check_shape(&shape, p.batch)?;
        self.run = None;
        self.peak = 0;
        self.paths = TopkPaths::default();
        self.folds = FoldCounts::default();
        if p.batch.num_rows() == 0 {
            // No rows: no tiles, empty outputs, nothing on the device (a zero-byte
            // allocation is an error there).
            return Ok(());
        }
        let dev = &self.dev;
        let mut up = Uploads::default();
        match p.inputs.q {
            Queries::E4m3(q) => up.q = Some(upload(dev, q.into_dyn(), "upload q")?),
            Queries::E2m1 { packed, scale } => {
                up.q = Some(upload(dev, packed.into_dyn(), "upload q")?);
                up.q_scale = Some(upload(dev, scale.into_dyn(), "upload q_scale")?);
            }
        }
        match p.inputs.k {
            Keys::E4m3 { codes, scale } => {
                up.k = Some(upload(dev, codes.into_dyn(), "upload k")?);
                up.k_scale32 = Some(upload(dev, scale.into_dyn(), "upload k_scale")?);
            }
            Keys::E2m1 { packed, scale } => {
                up.k = Some(upload(dev, packed.into_dyn(), "upload k")?);
                up.k_scale8 = Some(upload(dev, scale.into_dyn(), "upload k_scale")?);
            }
            Keys::Paged(pk) => {
                // The pool as it is and the page table: the kernels read the pages.
                up.k = Some(upload(dev, pk.kv_cache.into_dyn(), "upload kv_cache")?);
                up.page_table = Some(upload(dev, pk.page_table.into_dyn(), "upload page_table")?);
            }
        }
        up.w = Some(upload(dev, p.inputs.weights.into_dyn(), "upload weights")?);
        if let Some(slots) = p.inputs.k_slots {
            up.k_slots = Some(upload(dev, slots.into_dyn(), "upload k_slots")?);
        }
        if let Role::Consumer(c) = p.role {
            up.cblocks = Some(upload(
                dev,
                c.blocks.view().into_dyn(),
                "upload candidates",
            )?);
        }
        let ptrs = up.ptrs(&dev.stream);
        let run = Run::begin(
            &self.dev,
            &mut Space::Own,
            OutPlace::Own,
            p.batch,
            shape,
            ptrs,
            up,
            plan,
        )?;
        self.peak = run.transient;
        self.run = Some(run);
        Ok(())
    }
}

fn upload<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits + Copy>(
    dev: &Device,
    v: ndarray::ArrayViewD<'_, T>,
    what: &str,
) -> Result<CudaSlice<T>> {
    let host: Vec<T> = match v.as_slice() {
        Some(x) => x.to_vec(),
        None => v.iter().copied().collect(),
    };
    if host.is_empty() {
        // A zero-length allocation is not allowed: one element that nothing reads.
        return dev.allocate::<T>(Fill::OneUnread).map_err(drv(what));
    }
    dev.allocate(Fill::Host(&host)).map_err(drv(what))
}

fn shape_of(p: &Problem, precision: Precision, select: Option<SelectStream>) -> Shape {
    Shape {
        heads: p.heads,
        dim: p.dim,
        q: p.q_format(),
        k: p.k_format(),
        topk: p.topk,
        page_cols: p.page_cols,
        block_size: p.block_size,
        num_blocks: p.num_blocks,
        tail: match p.role {
            Role::Source { tail } => Some(tail),
            _ => None,
        },
        consumer: matches!(p.role, Role::Consumer(_)),
        paged: None,
        precision,
        select,
    }
}

/// Whether the CUDA backend's kernels read problem `p`'s pages straight through its page
/// table (SPEC 10): paged keys whose pages take a multiple of 16 bytes. Other paged
/// problems the backend gathers flat on the host first (the same outputs).
pub fn reads_pages(p: &Problem) -> bool {
    paging_of(p).is_some()
}

/// How the kernels read `p`'s pages, if its keys are paged and its pages take a multiple
/// of 16 bytes ([`Paging::new`]); `None` otherwise: flat keys, or pages this backend
/// gathers on the host (`P <= 2` for E4M3 keys and for E2M1 keys of `D = 128`, `P <= 4`
/// for E2M1 at `D = 64`, `P <= 8` at `D = 32`).
pub(super) fn paging_of(p: &Problem) -> Option<Paging> {
    let pk = p.paged()?;
    Paging::new(pk.format, p.dim, pk.page_size, pk.page_table.ncols()).ok()
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }
    fn max_topk(&self) -> usize {
        MAX_TOPK
    }
    fn footprint(&self, p: &Problem) -> RowFootprint {
        // The shape begin runs (paged keys the kernels cannot read run flat).
        let shape = Shape {
            paged: paging_of(p),
            ..shape_of(p, self.precision, self.select)
        };
        run_footprint(p.batch, &shape, self.dev.sm_count(), self.dev.hooks())
    }
    fn begin(&mut self, p: &Problem, plan: &Plan) -> Result<()> {
        // Paged keys (SPEC 10): the pool and the page table uploaded as they are, the
        // kernels read the pages. Pages the kernels cannot read (paging_of) are gathered
        // flat on the host and uploaded with their pool slots as k_slots: the same
        // outputs.
        match (p.paged(), paging_of(p)) {
            (Some(_), Some(pg)) => self.begin_inputs(p, plan, Some(pg)),
            (Some(_), None) => {
                let flat = p
                    .gather_keys()
                    .ok_or_else(|| backend_err("paged keys without pages"))?;
                self.begin_inputs(&p.with_flat_keys(&flat), plan, None)
            }
            (None, _) => self.begin_inputs(p, plan, None),
        }
    }
    fn tile(&mut self, _p: &Problem, _plan: &Plan, t: usize, _out: &mut Output) -> Result<()> {
        let run = self
            .run
            .as_mut()
            .ok_or_else(|| backend_err("tile before begin"))?;
        run.tile(&self.dev, t)
    }
    fn end(&mut self, _p: &Problem, out: &mut Output) -> Result<()> {
        self.end_keeping_uploads(out).map(drop)
    }
    fn device_peak(&self) -> Option<usize> {
        Some(self.peak)
    }
}

impl CudaBackend {
    /// [`Backend::end`], handing back the run's uploads of its host inputs (every other
    /// buffer of the run freed), so that a caller can bind other work to them instead of
    /// uploading the inputs again (the decode benchmark's engine entry). `None` when no
    /// run was begun, or it had no rows.
    pub(super) fn end_keeping_uploads(&mut self, out: &mut Output) -> Result<Option<Uploads>> {
        let Some(run) = self.run.take() else {
            return Ok(None);
        };
        let dev = &self.dev;
        let copy = |d: &Buf<i32>, h: &mut ndarray::Array2<i32>, what: &str| -> Result<()> {
            let v = dev.read_back(d, what)?;
            let n = h.len();
            let dst = h
                .as_slice_mut()
                .ok_or_else(|| backend_err("output not contiguous"))?;
            dst.copy_from_slice(&v[..n]);
            Ok(())
        };
        copy(&run.raw, &mut out.raw, "copy raw back")?;
        copy(&run.page, &mut out.page, "copy page back")?;
        if let (Some(d), Some(pb)) = (run.published.as_ref(), out.published.as_mut()) {
            copy(d, &mut pb.blocks, "copy published back")?;
        }
        let c = dev.read_back(&run.paths, "copy path counters back")?;
        self.paths = TopkPaths::from_device(&c);
        self.folds = FoldCounts::from_device(&c[kernels::TOPK_PATHS.len()..]);
        Ok(Some(run.into_uploads()))
    }
}

/// Run problem `p` on the shared CUDA device in tiles whose logits fit `budget` bytes.
pub fn run_cuda(p: &Problem, budget: usize) -> Result<(Output, Plan)> {
    let mut b = CudaBackend::new()?;
    crate::indexer::run(&mut b, p, budget)
}
