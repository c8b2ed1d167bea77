//! The engine API: a layer-forward whose inputs are already on the device, on the
//! caller's stream. Shapes are checked on the host, values on the device
//! ([`super::validate`]); the outputs stay on the device.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtrMut};

use super::alloc::{Buf, Fill, Space, WORKSPACE_ALIGN};
use super::device::{backend_err, drv, libraries_present, vptr, Device};
use super::geometry::{check_shape, run_footprint, Paging, Shape};
use super::kernels::{self, Hooks, Precision, SelectStream};
use super::run::{OutPlace, Ptrs, Run, Uploads};
use super::validate::{validate, validate_paged, Checked, PagedView};
use crate::batch::Batch;
use crate::error::{Error, Result};
use crate::plan::Plan;
use crate::problem::{Format, Params};

/// Alignment, in bytes, that [`Engine::run_device`] requires of the query and key
/// tensors' device addresses.
pub const INPUT_ALIGN: usize = 16;

/// Key values already on the device.
#[derive(Debug)]
pub enum DeviceKeys<'a> {
    /// E4M3 `[L, D]` and f32 per-key scales `[L]`.
    E4m3 {
        /// Codes.
        codes: CudaView<'a, u8>,
        /// Per-key scale.
        scale: CudaView<'a, f32>,
    },
    /// Packed E2M1 `[L, D/2]` and UE8M0 `[L, D/32]`.
    E2m1 {
        /// Packed codes.
        packed: CudaView<'a, u8>,
        /// Group scales.
        scale: CudaView<'a, u8>,
    },
    /// Keys in a page pool (SPEC 10), read by the kernels through the page table.
    Paged {
        /// Element format.
        format: Format,
        /// The pool, `u8 [num_pages, P * bytes_per_token]` row-major, on a 16-byte
        /// boundary; `P * bytes_per_token` must be a multiple of 16 (the kernels' key
        /// loads; `P >= 4` for E4M3 keys).
        kv_cache: CudaView<'a, u8>,
        /// `i32 [B, max_pages]`, row-major: key `j` of request `b` is at slot `j % P`
        /// of page `page_table[b, j / P]`.
        page_table: CudaView<'a, i32>,
        /// `max_pages`: page-table entries per request.
        max_pages: usize,
        /// `P`: tokens per page, a power of two in 1..=256.
        page_size: usize,
    },
}

/// Query values already on the device.
#[derive(Debug)]
pub enum DeviceQueries<'a> {
    /// E4M3 `[T, H, D]`.
    E4m3(CudaView<'a, u8>),
    /// Packed E2M1 `[T, H, D/2]` and UE8M0 `[T, H, D/32]`.
    E2m1 {
        /// Packed codes.
        packed: CudaView<'a, u8>,
        /// Group scales.
        scale: CudaView<'a, u8>,
    },
}

/// A layer-forward whose inputs live on the device. Shapes are checked against the
/// batch on the host; element values (SPEC 8: no NaN E4M3 codes, no UE8M0 255, finite
/// weights, finite positive key scales, slots >= 0) on the device, with the errors
/// [`Problem::new`](crate::problem::Problem::new) gives for the same host arrays. Consumer candidates are checked for
/// their shape only.
#[derive(Debug)]
pub struct DeviceInputs<'a> {
    /// `H`.
    pub heads: usize,
    /// `D`.
    pub dim: usize,
    /// Queries.
    pub q: DeviceQueries<'a>,
    /// Keys.
    pub k: DeviceKeys<'a>,
    /// Weights `[T, H]`.
    pub weights: CudaView<'a, f32>,
    /// Pool slots `[L]`; `None` is the identity.
    pub k_slots: Option<CudaView<'a, i32>>,
}

/// What a device run leaves on the device.
#[derive(Debug)]
pub struct DeviceOutput {
    /// `raw [T, K]`, row-major.
    pub raw: CudaSlice<i32>,
    /// `page [T, page_cols]`.
    pub page: CudaSlice<i32>,
    /// Source layers: `[P, NB]` kept block ids.
    pub published: Option<CudaSlice<i32>>,
    /// The plan it ran.
    pub plan: Plan,
    /// Transient device bytes it allocated.
    pub measured_peak: usize,
}

/// The engine entry point: a device (possibly on the caller's stream).
#[derive(Debug, Clone)]
pub struct Engine {
    pub(super) dev: Arc<Device>,
    pub(super) precision: Precision,
    select: Option<SelectStream>,
}

impl Engine {
    /// On the caller's stream (its context must be an sm_90 GPU).
    pub fn on_stream(stream: Arc<CudaStream>) -> Result<Engine> {
        Engine::on_stream_with_hooks(stream, Hooks::default())
    }

    /// On `dev`'s stream, sharing its compiled modules.
    pub fn on_device(dev: Arc<Device>) -> Engine {
        Engine {
            dev,
            precision: Precision::Full,
            select: kernels::select_stream(),
        }
    }

    /// This engine with the tolerance class's logits under `precision` (its layer
    /// entry and its decode step; [`Precision::Full`] by default).
    pub fn with_precision(mut self, precision: Precision) -> Engine {
        self.precision = precision;
        self
    }

    /// The precision the tolerance class's logits run under.
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// This engine with each tile of its layer entry's runs selected on a stream of its
    /// own, at `priority`, beside the next tile's logits (`None`: one stream; the decode
    /// step is one tile). As [`crate::cuda::CudaBackend::with_select_stream`]: opt-in,
    /// the same bits, the default `None` or the `SELECT_STREAM` define of a `tuning` build.
    pub fn with_select_stream(mut self, priority: Option<SelectStream>) -> Engine {
        self.select = priority;
        self
    }

    /// The selection's own stream's priority, if its layer entry's runs have one.
    pub fn select_stream(&self) -> Option<SelectStream> {
        self.select
    }

    /// [`Engine::on_stream`] with the kernels compiled and chosen under test hooks
    /// `hooks` ([`Device::with_stream_and_hooks`]).
    pub fn on_stream_with_hooks(stream: Arc<CudaStream>, hooks: Hooks) -> Result<Engine> {
        if !libraries_present() {
            return Err(backend_err("no CUDA: libcuda or libnvrtc not found"));
        }
        Ok(Engine::on_device(Device::with_stream_and_hooks(
            stream, hooks,
        )?))
    }

    /// Run a plain or source layer (`tail`: `None` plain, `Some(t)` source) whose
    /// inputs are on the device; the outputs stay there. Consumer layers take
    /// `candidates` (`[T, NB]` on the device).
    ///
    /// After the host checks, one kernel scans the inputs' values (SPEC 8) and the host
    /// reads back its 8-byte verdict: the call waits once for the engine's stream (and
    /// the work queued on it before), then queues the run and returns without waiting
    /// again (outputs are ready in stream order). A bad value is the error
    /// [`Problem::new`](crate::problem::Problem::new) gives for the same host arrays (the first offender in its order
    /// of checks: q or q_scale, k, k_scale, weights, k_slots), and nothing runs.
    ///
    /// Paged keys ([`DeviceKeys::Paged`]) are read by the kernels through the page
    /// table. Their shapes are checked on the host, then (between the queries' and the
    /// weights' checks) the used page-table entries and the slots some request reads
    /// on the device, two more launches and one more wait; `page` reports pool slots.
    ///
    /// The outputs and the transient buffers are the backend's own allocations; a caller
    /// whose framework owns the memory uses [`Engine::prepare_device`] instead.
    #[allow(clippy::too_many_arguments)]
    pub fn run_device(
        &self,
        batch: &Batch,
        inputs: &DeviceInputs<'_>,
        params: Params,
        source_tail: Option<Option<usize>>,
        candidates: Option<&CudaView<'_, i32>>,
        budget: usize,
    ) -> Result<DeviceOutput> {
        let r = self.prepare_device(batch, inputs, params, source_tail, candidates, budget)?;
        validate_values(&self.dev, &Space::Own, batch, inputs, r.paged)?;
        check_alignment(&r.ptrs, r.keys_field())?;
        if batch.num_rows() == 0 {
            return empty_output(&self.dev, source_tail, r.plan);
        }
        self.run_tiles(batch, r.shape, r.ptrs, r.plan)
    }

    /// The host half of [`Engine::run_device`] for a caller that provides the memory:
    /// every shape check and the plan, nothing queued. The [`DeviceRun`] says how many
    /// workspace bytes the run takes ([`DeviceRun::workspace_bytes`]); its
    /// [`DeviceRun::launch`] then checks the values and queues the run into the caller's
    /// outputs and workspace, allocating nothing.
    #[allow(clippy::too_many_arguments)]
    pub fn prepare_device<'r, 'a>(
        &'r self,
        batch: &'r Batch,
        inputs: &'r DeviceInputs<'a>,
        params: Params,
        source_tail: Option<Option<usize>>,
        candidates: Option<&'r CudaView<'a, i32>>,
        budget: usize,
    ) -> Result<DeviceRun<'r, 'a>> {
        let s = self.dev.stream.clone();
        let t = batch.num_rows();
        let (mut ptrs, qf, kf, paged) = input_ptrs(&s, batch, inputs)?;
        let page_cols = check_params(&params, source_tail)?;
        if let Some(c) = candidates {
            check_len("candidates", c.len(), t * params.num_blocks)?;
            ptrs.cblocks = vptr(c, &s);
        }
        let shape = Shape {
            heads: inputs.heads,
            dim: inputs.dim,
            q: qf,
            k: kf,
            topk: params.topk,
            page_cols,
            block_size: params.block_size,
            num_blocks: params.num_blocks,
            tail: source_tail,
            consumer: candidates.is_some(),
            paged,
            precision: self.precision,
            select: self.select,
        };
        check_shape(&shape, batch)?;
        let plan = plan_run(batch, &shape, budget, self.dev.sm_count(), self.dev.hooks())?;
        let published_rows = batch
            .rows()
            .iter()
            .filter(|r| shape.publishes(r, batch.requests()))
            .count();
        let mut r = DeviceRun {
            engine: self,
            batch,
            inputs,
            shape,
            ptrs,
            plan,
            paged,
            published_rows,
            workspace: 0,
        };
        // The workspace: the value checks' scratch (freed before the run takes its
        // buffers: the checks wait for their verdict), or the run's buffers.
        let checks = validate_values(&self.dev, &Space::Measure { at: 0 }, batch, inputs, paged)?;
        let run = if t == 0 {
            0
        } else {
            let mut space = Space::Measure { at: 0 };
            r.begin(
                &mut space,
                OutPlace::At {
                    raw: 0,
                    page: 0,
                    published: 0,
                },
            )?;
            space.used()
        };
        r.workspace = checks.max(run);
        Ok(r)
    }

    /// Device bytes this engine's backend has allocated itself so far (its
    /// [`Device::allocated_bytes`]): 0 after any number of [`DeviceRun::launch`]es on an
    /// engine made with [`Engine::on_device`] over a fresh [`Device::on_stream`].
    pub fn allocated_bytes(&self) -> u64 {
        self.dev.allocated_bytes()
    }

    /// Queue every tile of `plan` for a checked layer of shape `shape` whose inputs are
    /// at `ptrs`, in buffers of the backend's own; the outputs stay on the device.
    fn run_tiles(
        &self,
        batch: &Batch,
        shape: Shape,
        ptrs: Ptrs,
        plan: Plan,
    ) -> Result<DeviceOutput> {
        let mut run = Run::begin(
            &self.dev,
            &mut Space::Own,
            OutPlace::Own,
            batch,
            shape,
            ptrs,
            Uploads::default(),
            &plan,
        )?;
        for ti in 0..plan.tiles.len() {
            run.tile(&self.dev, ti)?;
        }
        let measured_peak = run.transient;
        let own = |b: Buf<i32>, what: &str| {
            b.into_owned()
                .ok_or_else(|| backend_err(format!("{what}: not the run's own buffer")))
        };
        Ok(DeviceOutput {
            raw: own(run.raw, "raw")?,
            page: own(run.page, "page")?,
            published: run.published.map(|p| own(p, "published")).transpose()?,
            plan,
            measured_peak,
        })
    }
}

/// A checked and planned device run whose memory the caller provides
/// ([`Engine::prepare_device`]): it borrows the inputs until it is launched.
#[derive(Debug)]
pub struct DeviceRun<'r, 'a> {
    engine: &'r Engine,
    batch: &'r Batch,
    inputs: &'r DeviceInputs<'a>,
    shape: Shape,
    ptrs: Ptrs,
    plan: Plan,
    paged: Option<Paging>,
    published_rows: usize,
    workspace: usize,
}

/// What a [`DeviceRun::launch`] reports.
#[derive(Debug, Clone)]
pub struct DeviceRunInfo {
    /// The plan it ran.
    pub plan: Plan,
    /// Bytes of the workspace its transient buffers took (the counted peak; the value
    /// checks' scratch comes before and is not part of it).
    pub measured_peak: usize,
}

impl DeviceRun<'_, '_> {
    /// Bytes of device workspace [`DeviceRun::launch`] needs, a multiple of
    /// [`WORKSPACE_ALIGN`].
    pub fn workspace_bytes(&self) -> usize {
        self.workspace
    }

    /// The plan the run will follow.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// `(raw, page, published)` lengths the outputs must have: `T x K`, `T x page_cols`,
    /// and for a source layer `published rows x NB` (0 otherwise).
    pub fn output_lens(&self) -> (usize, usize, usize) {
        let (raw, page, published) = self
            .shape
            .output_lens(self.batch.num_rows(), self.published_rows);
        (raw, page, published.unwrap_or(0))
    }

    fn keys_field(&self) -> &'static str {
        if self.paged.is_some() {
            "kv_cache"
        } else {
            "k"
        }
    }

    fn begin(&self, space: &mut Space, out: OutPlace) -> Result<Run> {
        let dev = &self.engine.dev;
        Run::begin(
            dev,
            space,
            out,
            self.batch,
            self.shape,
            self.ptrs,
            Uploads::default(),
            &self.plan,
        )
    }

    /// Check the inputs' values on the device (as [`Engine::run_device`] does: one wait
    /// for the stream, two more over paged keys), then queue the run on the engine's
    /// stream, its outputs into `raw` (`T x K`), `page` (`T x page_cols`) and, for a
    /// source layer, `published` (`published rows x NB`), every transient buffer a
    /// region of `workspace` (at least [`DeviceRun::workspace_bytes`] bytes, on a
    /// [`WORKSPACE_ALIGN`]-byte boundary). Nothing is allocated; the outputs are ready
    /// in stream order. The caller keeps `workspace` alive and untouched until the
    /// stream has run the work queued here.
    pub fn launch(
        self,
        raw: &mut CudaViewMut<'_, i32>,
        page: &mut CudaViewMut<'_, i32>,
        published: Option<&mut CudaViewMut<'_, i32>>,
        workspace: &mut CudaViewMut<'_, u8>,
    ) -> Result<DeviceRunInfo> {
        let dev = &self.engine.dev;
        let s = dev.stream.clone();
        let (nraw, npage, npub) = self.output_lens();
        check_len("raw", raw.len(), nraw)?;
        check_len("page", page.len(), npage)?;
        let published = match (published, self.shape.tail) {
            (Some(p), Some(_)) => {
                check_len("published", p.len(), npub)?;
                Some(p)
            }
            (None, Some(_)) => {
                return Err(Error::range(
                    "published",
                    "none",
                    "a buffer (a source layer)",
                ));
            }
            (Some(_), None) => {
                return Err(Error::range(
                    "published",
                    "a buffer",
                    "none (not a source layer)",
                ))
            }
            (None, None) => None,
        };
        let ws_len = workspace.len();
        if ws_len < self.workspace {
            return Err(Error::range(
                "workspace",
                format!("{ws_len} bytes, of {} needed", self.workspace),
                "at least DeviceRun::workspace_bytes bytes",
            ));
        }
        let (base, _g) = workspace.device_ptr_mut(&s);
        if !base.is_multiple_of(WORKSPACE_ALIGN as u64) {
            return Err(Error::range(
                "workspace",
                format!("device address {base:#x}"),
                "a 256-byte aligned device address",
            ));
        }
        let carve = Space::Carve {
            base,
            len: ws_len,
            at: 0,
        };
        validate_values(dev, &carve, self.batch, self.inputs, self.paged)?;
        check_alignment(&self.ptrs, self.keys_field())?;
        if self.batch.num_rows() == 0 {
            return Ok(DeviceRunInfo {
                plan: self.plan,
                measured_peak: 0,
            });
        }
        let (raw_p, _g1) = raw.device_ptr_mut(&s);
        let (page_p, _g2) = page.device_ptr_mut(&s);
        let pub_p = match published {
            Some(p) => p.device_ptr_mut(&s).0,
            None => 0,
        };
        let out = OutPlace::At {
            raw: raw_p,
            page: page_p,
            published: pub_p,
        };
        let mut space = carve;
        let mut run = self.begin(&mut space, out)?;
        for ti in 0..self.plan.tiles.len() {
            run.tile(dev, ti)?;
        }
        Ok(DeviceRunInfo {
            measured_peak: run.transient,
            plan: self.plan,
        })
    }
}

/// A shape error for `field` unless its length `got` is `want`.
pub(super) fn check_len(field: &str, got: usize, want: usize) -> Result<()> {
    if got != want {
        return Err(Error::shape(field, &[got], &[want]));
    }
    Ok(())
}

/// The device addresses and formats of `inputs` (`Ptrs::cblocks` left 0) and how the
/// kernels read paged keys, after checking `H`, `D` and every tensor's length against
/// `batch`.
fn input_ptrs(
    s: &CudaStream,
    batch: &Batch,
    inputs: &DeviceInputs<'_>,
) -> Result<(Ptrs, Format, Format, Option<Paging>)> {
    let (t, l) = (batch.num_rows(), batch.num_keys());
    let (h, d) = (inputs.heads, inputs.dim);
    if !(h.is_power_of_two() && (8..=64).contains(&h)) {
        return Err(Error::range("heads", h, "a power of two in 8..=64"));
    }
    if ![32, 64, 128].contains(&d) {
        return Err(Error::range("dim", d, "32, 64 or 128"));
    }
    let g = d / 32;
    let mut ptrs = Ptrs::default();
    let mut paged = None;
    let qf = match &inputs.q {
        DeviceQueries::E4m3(q) => {
            check_len("q", q.len(), t * h * d)?;
            ptrs.q = vptr(q, s);
            Format::E4m3
        }
        DeviceQueries::E2m1 { packed, scale } => {
            check_len("q", packed.len(), t * h * d / 2)?;
            check_len("q_scale", scale.len(), t * h * g)?;
            ptrs.q = vptr(packed, s);
            ptrs.q_scale = vptr(scale, s);
            Format::E2m1
        }
    };
    let kf = match &inputs.k {
        DeviceKeys::E4m3 { codes, scale } => {
            check_len("k", codes.len(), l * d)?;
            check_len("k_scale", scale.len(), l)?;
            ptrs.k = vptr(codes, s);
            ptrs.k_bytes = codes.len() as u64;
            ptrs.k_scale32 = vptr(scale, s);
            Format::E4m3
        }
        DeviceKeys::E2m1 { packed, scale } => {
            check_len("k", packed.len(), l * d / 2)?;
            check_len("k_scale", scale.len(), l * g)?;
            ptrs.k = vptr(packed, s);
            ptrs.k_bytes = packed.len() as u64;
            ptrs.k_scale8 = vptr(scale, s);
            Format::E2m1
        }
        DeviceKeys::Paged {
            format,
            kv_cache,
            page_table,
            max_pages,
            page_size,
        } => {
            let pg = paged_shapes(
                s, batch, d, *format, kv_cache, page_table, *max_pages, *page_size,
            )?;
            if inputs.k_slots.is_some() {
                return Err(Error::range(
                    "k_slots",
                    "given",
                    "none with paged keys: page reports pool slots (SPEC 10)",
                ));
            }
            paged = Some(pg);
            ptrs.k = vptr(kv_cache, s);
            ptrs.k_bytes = kv_cache.len() as u64;
            ptrs.page_table = vptr(page_table, s);
            *format
        }
    };
    check_len("weights", inputs.weights.len(), t * h)?;
    ptrs.w = vptr(&inputs.weights, s);
    if let Some(slots) = &inputs.k_slots {
        check_len("k_slots", slots.len(), l)?;
        ptrs.k_slots = vptr(slots, s);
    }
    Ok((ptrs, qf, kf, paged))
}

/// The pool's checks that need no batch: the kernels can read its pages
/// ([`Paging::new`]), it starts on a 16-byte boundary (before the values:
/// validate_slots reads the pages with word loads), it is a whole number of pages, and
/// its slots fit an i32.
pub(super) fn pool_shape(
    s: &CudaStream,
    dim: usize,
    format: Format,
    kv_cache: &CudaView<'_, u8>,
    page_size: usize,
    max_pages: usize,
) -> Result<Paging> {
    let pg = Paging::new(format, dim, page_size, max_pages)?;
    let addr = vptr(kv_cache, s);
    if !addr.is_multiple_of(INPUT_ALIGN as u64) {
        return Err(Error::range(
            "kv_cache",
            format!("device address {addr:#x}"),
            "a 16-byte aligned device address (the start of an allocation, or a view at a multiple of 16 bytes)",
        ));
    }
    let page_bytes = page_size * crate::paged::bytes_per_token(format, dim);
    if !kv_cache.len().is_multiple_of(page_bytes) {
        return Err(Error::range(
            "kv_cache",
            format!("{} bytes", kv_cache.len()),
            "a whole number of pages of P * bytes_per_token bytes",
        ));
    }
    let slots = kv_cache.len() / page_bytes * page_size;
    if slots > i32::MAX as usize {
        return Err(Error::range(
            "kv_cache slots",
            slots,
            "num_pages * page_size <= 2^31 - 1 (page is i32)",
        ));
    }
    Ok(pg)
}

/// SPEC 8's shape checks of paged keys on the device (those of
/// [`crate::paged::PagedKeys::validate`] before its values), and that the kernels can
/// read the pages ([`Paging::new`]).
#[allow(clippy::too_many_arguments)]
pub(super) fn paged_shapes(
    s: &CudaStream,
    batch: &Batch,
    dim: usize,
    format: Format,
    kv_cache: &CudaView<'_, u8>,
    page_table: &CudaView<'_, i32>,
    max_pages: usize,
    page_size: usize,
) -> Result<Paging> {
    let pg = pool_shape(s, dim, format, kv_cache, page_size, max_pages)?;
    let reqs = batch.requests();
    check_len("page_table", page_table.len(), reqs.len() * max_pages)?;
    for (b, r) in reqs.iter().enumerate() {
        if r.keys.div_ceil(page_size) > max_pages {
            return Err(Error::range(
                format!("page_table[{b}]"),
                format!("{max_pages} entries"),
                "at least ceil(L_b / page_size) entries for every request",
            ));
        }
    }
    Ok(pg)
}

/// Check `params` and the source layer's tail; the page width (`page_cols`, or `K`
/// rounded up to 64).
fn check_params(params: &Params, source_tail: Option<Option<usize>>) -> Result<usize> {
    if params.topk == 0 {
        return Err(Error::range("topk", 0, "1 ..= 65536"));
    }
    let page_cols = crate::problem::page_cols_for(params.topk, params.page_cols)?;
    if params.block_size == 0 {
        return Err(Error::range("block_size", 0, "block_size >= 1"));
    }
    crate::problem::check_num_blocks(params.num_blocks)?;
    if let Some(Some(0)) = source_tail {
        return Err(Error::range("tail", 0, "tail >= 1"));
    }
    Ok(page_cols)
}

/// The plan of a layer of shape `shape` over `batch` under `budget`, with this
/// backend's footprint on a GPU of `sms` SMs whose kernels run under `hooks`.
fn plan_run(batch: &Batch, shape: &Shape, budget: usize, sms: usize, hooks: Hooks) -> Result<Plan> {
    let pp = crate::plan::PlanParams {
        heads: shape.heads,
        dim: shape.dim,
        topk: shape.topk,
        block_size: shape.block_size,
        num_blocks: shape.num_blocks,
        role: match (shape.tail, shape.consumer) {
            (Some(tail), _) => crate::plan::PlanRole::Source { tail },
            (None, true) => crate::plan::PlanRole::Consumer,
            _ => crate::plan::PlanRole::Plain,
        },
        budget,
    };
    crate::plan::plan(batch, &pp, &run_footprint(batch, shape, sms, hooks))
}

/// SPEC 8's value checks of `inputs` on the device, in Problem::new's order: over paged
/// keys (`paged`, from [`paged_shapes`]) the queries, then the used page-table entries and
/// the slots some request of `batch` reads, then the weights; else every tensor at once.
///
/// Each check's scratch is taken afresh from `space` (they wait for their verdicts, so
/// one can reuse another's); returns the most workspace bytes one took (0 for
/// [`Space::Own`]; under [`Space::Measure`] nothing runs).
pub(super) fn validate_values(
    dev: &Device,
    space: &Space,
    batch: &Batch,
    inputs: &DeviceInputs<'_>,
    paged: Option<Paging>,
) -> Result<usize> {
    let values = checked_values(inputs);
    match (&inputs.k, paged) {
        (
            DeviceKeys::Paged {
                format,
                kv_cache,
                page_table,
                max_pages,
                ..
            },
            Some(pg),
        ) => {
            let q = validate(dev, space.fresh(), &values[..1])?;
            // validate_slots reads the pool a word at a time (the logits kernels 16 bytes
            // at a time): a view off a 16-byte boundary is an error before anything reads
            // it, where a misaligned load would fault the context.
            aligned("kv_cache", vptr(kv_cache, &dev.stream))?;
            let view = PagedView {
                format: *format,
                dim: inputs.dim,
                kv_cache,
                page_table,
                cols: *max_pages,
                page_log2: pg.page_log2,
                num_pages: kv_cache.len()
                    / (crate::paged::bytes_per_token(*format, inputs.dim) << pg.page_log2),
            };
            let pages = validate_paged(dev, space.fresh(), batch, &view)?;
            let rest = validate(dev, space.fresh(), &values[1..])?;
            Ok(q.max(pages).max(rest))
        }
        _ => validate(dev, space.fresh(), &values),
    }
}

/// SPEC 8's value checks of `inputs`, in Problem::new's order (keys too when there are
/// no rows).
fn checked_values<'v, 'a>(inputs: &'v DeviceInputs<'a>) -> Vec<Checked<'v, 'a>> {
    let mut checked = Vec::with_capacity(kernels::VALIDATE_SEGMENTS);
    match &inputs.q {
        DeviceQueries::E4m3(q) => checked.push(Checked::E4m3("q", q)),
        DeviceQueries::E2m1 { scale, .. } => checked.push(Checked::Ue8m0("q_scale", scale)),
    }
    match &inputs.k {
        DeviceKeys::E4m3 { codes, scale } => {
            checked.push(Checked::E4m3("k", codes));
            checked.push(Checked::KeyScale(scale));
        }
        DeviceKeys::E2m1 { scale, .. } => checked.push(Checked::Ue8m0("k_scale", scale)),
        // Checked by validate_paged, between the queries and the weights.
        DeviceKeys::Paged { .. } => {}
    }
    checked.push(Checked::Weights(&inputs.weights));
    if let Some(slots) = &inputs.k_slots {
        checked.push(Checked::Slots(slots));
    }
    checked
}

/// The kernels read query and key rows with 16-byte (and 4-byte) vector loads:
/// their tensors must start on a 16-byte boundary (every cudarc allocation does;
/// a view into one need not). Checked after the values, so that a bad value is
/// reported as Problem::new reports it, wherever it sits (validate_inputs reads any
/// alignment); a paged pool's alignment is checked before its values are read
/// ([`validate_values`]).
fn check_alignment(ptrs: &Ptrs, keys: &'static str) -> Result<()> {
    aligned("q", ptrs.q)?;
    aligned(keys, ptrs.k)
}

/// The error for a kernel input `field` at device address `addr` off a 16-byte boundary.
pub(super) fn aligned(field: &'static str, addr: u64) -> Result<()> {
    if !addr.is_multiple_of(INPUT_ALIGN as u64) {
        return Err(Error::range(
            field,
            format!("device address {addr:#x}"),
            "a 16-byte aligned device address (the start of an allocation, or a view at a multiple of 16 bytes)",
        ));
    }
    Ok(())
}

/// The outputs of a run with no rows: empty device buffers, nothing launched.
fn empty_output(
    dev: &Device,
    source_tail: Option<Option<usize>>,
    plan: Plan,
) -> Result<DeviceOutput> {
    let none = |what: &str| dev.allocate::<i32>(Fill::Empty).map_err(drv(what));
    Ok(DeviceOutput {
        raw: none("empty raw")?,
        page: none("empty page")?,
        published: match source_tail {
            Some(_) => Some(none("empty published")?),
            None => None,
        },
        plan,
        measured_peak: 0,
    })
}
