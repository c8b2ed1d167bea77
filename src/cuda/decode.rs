//! The decode step (SPEC 10): queries of the `next_n` newest positions of each request
//! against its keys in the engine's paged KV cache, every launch shape fixed by host
//! scalars so that a CUDA graph can capture it.
//!
//! [`Engine::decode_step`] checks the shapes, resolves every device address (the
//! caller's views, its workspace, its outputs) and compiles the kernels; the
//! [`DecodeStep`] it returns launches, on the engine's stream:
//! 1. `decode_rows`: each row's visible keys, page-table row and logits offset, and the
//!    row groups, from `context_lens` on the device;
//! 2. the paged logits kernel over `ceil(max_context / r / 64)` key tiles of every
//!    request, split across blocks so that every SM is busy at batch 1 and at 128;
//! 3. the top-k (split into segments for few rows, one block per row else), `raw` and
//!    `page`, each selected key's pool slot read from the page table.
//!
//! [`DecodeStep::launch`] allocates nothing, does not synchronise, reads nothing back
//! and depends on no device value on the host: replaying it with other context lengths
//! and page tables written into the same buffers is the same launch sequence.
//! Values are not checked there; [`Engine::decode_check`] is the separate, optional
//! check (SPEC 8), with [`crate::problem::Problem::new`]'s errors.

use std::marker::PhantomData;

use cudarc::driver::{
    CudaFunction, CudaView, CudaViewMut, DevicePtrMut, LaunchConfig, PushKernelArg,
};

use super::alloc::Space;
use super::device::{drv, vptr};
use super::engine::{
    aligned, check_len, paged_shapes, pool_shape, validate_values, DeviceInputs, DeviceKeys,
    DeviceQueries, Engine,
};
use super::geometry::{
    long_rows_launch, short_launch_smem, split_segments, RowTopk, MAX_TOPK, PATHS_BYTES, ROW_ALIGN,
    SPLIT_BYTES_PER_ID,
};
use super::kernels::{self, LogitsEntry, Variant};
use super::launch::{
    self, allow_dynamic_smem, LogitsArgs, SlotTable, TopkMergeArgs, TopkRowsArgs, TopkSegmentsArgs,
};
use crate::batch::Batch;
use crate::error::{Error, Result};
use crate::problem::Format;

/// The host scalars a decode step's launch shapes depend on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeShape {
    /// `B`: requests.
    pub batch: usize,
    /// Rows per request: the `next_n` newest positions (1, or 2..4 with speculative
    /// decoding).
    pub next_n: usize,
    /// The largest `S_b` (tokens) any launch of the step may see; longer contexts are
    /// cut to it.
    pub max_context: usize,
    /// `H`.
    pub heads: usize,
    /// `D`.
    pub dim: usize,
    /// Query format.
    pub q: Format,
    /// Key format (of the pool).
    pub k: Format,
    /// `K`.
    pub topk: usize,
    /// Width of `page` (`>= K`); `None` is `K` rounded up to a multiple of 64.
    pub page_cols: Option<usize>,
    /// `P`: tokens per page.
    pub page_size: usize,
    /// Page-table entries per request (`page_table` is `[B, max_pages]`).
    pub max_pages: usize,
    /// Compression ratio `r` (SPEC 3): request `b` has `S_b / r` keys.
    pub ratio: usize,
}

impl DecodeShape {
    /// `B * next_n`: the step's rows.
    pub fn rows(&self) -> usize {
        self.batch * self.next_n
    }

    /// Keys of the longest context: `max_context / r`.
    pub fn max_keys(&self) -> usize {
        self.max_context / self.ratio.max(1)
    }

    /// The width of `page`.
    pub fn page_width(&self) -> usize {
        self.page_cols.unwrap_or(self.topk.div_ceil(64) * 64)
    }
}

/// A decode step's inputs on the device.
#[derive(Debug)]
pub struct DecodeInputs<'a> {
    /// Queries `[B * next_n, H, ..]`, request after request, oldest position first.
    pub q: DeviceQueries<'a>,
    /// Weights `[B * next_n, H]`.
    pub weights: CudaView<'a, f32>,
    /// The pool, `u8 [num_pages, P * bytes_per_token]` (SPEC 10), 16-byte aligned.
    pub kv_cache: CudaView<'a, u8>,
    /// `i32 [B, max_pages]`.
    pub page_table: CudaView<'a, i32>,
    /// `S_b` per request, `i32 [B]`: the rows of request `b` are positions
    /// `S_b - next_n .. S_b` (rows at negative positions see no keys).
    pub context_lens: CudaView<'a, i32>,
}

/// Bytes of workspace a decode step of `shape` takes on a GPU of `sms` SMs: the rows'
/// metadata, the path counters, the logits of every row at the longest context
/// (`B * next_n * ceil16(max_context / r) * 4`), and the split top-k's scratch.
pub fn decode_workspace_bytes(shape: &DecodeShape, sms: usize) -> usize {
    Layout::of(shape, sms).total
}

/// A decode step's workspace of `shape` on a GPU of `sms` SMs, term by term (each
/// rounded up to 256 bytes; they sum to [`decode_workspace_bytes`]): the rows' metadata
/// (visible keys, page-table rows, logits offsets, row groups), the path counters, the
/// logits of every row at the longest context, and the split top-k's scratch.
pub fn decode_workspace_terms(shape: &DecodeShape, sms: usize) -> [(&'static str, usize); 4] {
    let l = Layout::of(shape, sms);
    [
        ("row_metadata", l.paths - l.row_n),
        ("path_counters", l.logits - l.paths),
        ("logits", l.split - l.logits),
        ("split_topk_scratch", l.total - l.split),
    ]
}

/// Byte offsets of a decode step's workspace regions, each 256-byte aligned.
#[derive(Debug, Clone, Copy)]
struct Layout {
    row_n: usize,
    row_ks: usize,
    row_off: usize,
    groups: usize,
    paths: usize,
    logits: usize,
    split: usize,
    total: usize,
    /// Floats per logits row.
    stride: usize,
    /// Top-k segments per row (1: one block per row).
    segments: usize,
}

impl Layout {
    fn of(shape: &DecodeShape, sms: usize) -> Layout {
        let r = shape.rows();
        let max_keys = shape.max_keys();
        let stride = max_keys.div_ceil(ROW_ALIGN).max(1) * ROW_ALIGN;
        let segments = split_segments(r, max_keys, shape.topk, sms);
        let mut at = 0usize;
        let mut region = |bytes: usize| {
            let start = at;
            at = (at + bytes).div_ceil(256) * 256;
            start
        };
        let row_n = region(4 * r);
        let row_ks = region(4 * r);
        let row_off = region(8 * r);
        // Row groups: at most one per row.
        let groups = region(16 * r);
        let paths = region(PATHS_BYTES);
        let logits = region(4 * r * stride);
        let split = region(if segments > 1 {
            SPLIT_BYTES_PER_ID * r * segments * shape.topk
        } else {
            0
        });
        Layout {
            row_n,
            row_ks,
            row_off,
            groups,
            paths,
            logits,
            split,
            total: at,
            stride,
            segments,
        }
    }
}

/// A decode step's kernels.
#[derive(Debug)]
struct Functions {
    rows: CudaFunction,
    logits: CudaFunction,
    segments: CudaFunction,
    merge: CudaFunction,
    short: CudaFunction,
    ragged: CudaFunction,
    wide: CudaFunction,
    cluster: CudaFunction,
}

impl Functions {
    /// The row top-k entry's function.
    fn row_topk(&self, entry: RowTopk) -> &CudaFunction {
        match entry {
            RowTopk::Short => &self.short,
            RowTopk::Ragged => &self.ragged,
            RowTopk::Wide => &self.wide,
            RowTopk::Cluster => &self.cluster,
        }
    }
}

/// The shared-memory row capacity of a decode step's `topk_short_f32` launch: the
/// longest context's keys (or the cap), when longer than `K`; 0 for none.
fn short_row_cap(shape: &DecodeShape, hooks: kernels::Hooks) -> u32 {
    let short = kernels::topk_short_cap(hooks).min(shape.max_keys());
    if short > shape.topk {
        short.next_multiple_of(8) as u32
    } else {
        0
    }
}

/// A decode step bound to its buffers: [`DecodeStep::launch`] queues it on the engine's
/// stream, as often as the caller wants (inside a CUDA graph capture too). The views it
/// was made from must stay alive and unmoved while it exists.
#[derive(Debug)]
pub struct DecodeStep<'a> {
    engine: Engine,
    shape: DecodeShape,
    /// Kernels, compiled and configured when the step is made.
    f: Functions,
    lg_entry: LogitsEntry,
    lg_rows: usize,
    lg_threads: usize,
    logits_args: LogitsArgs,
    context_lens: u64,
    raw: u64,
    page: u64,
    ws: u64,
    layout: Layout,
    _views: PhantomData<&'a ()>,
}

impl Engine {
    /// Bytes of workspace [`Engine::decode_step`] needs for `shape` on this GPU.
    pub fn decode_workspace_bytes(&self, shape: &DecodeShape) -> usize {
        decode_workspace_bytes(shape, self.dev.sm_count())
    }

    /// Bind a decode step of `shape` to its inputs, its outputs (`raw [B * next_n, K]`,
    /// `page [B * next_n, page_cols]`) and a workspace of at least
    /// [`Engine::decode_workspace_bytes`] bytes. Checks every shape and compiles the
    /// kernels; reads no device value.
    pub fn decode_step<'a>(
        &self,
        shape: &DecodeShape,
        inputs: &'a DecodeInputs<'_>,
        raw: &'a mut CudaViewMut<'_, i32>,
        page: &'a mut CudaViewMut<'_, i32>,
        workspace: &'a mut CudaViewMut<'_, u8>,
    ) -> Result<DecodeStep<'a>> {
        check_decode_shape(shape)?;
        let s = self.dev.stream.clone();
        let (r, h, d) = (shape.rows(), shape.heads, shape.dim);
        let g = d / 32;
        let mut ptrs = (0u64, 0u64);
        match (&inputs.q, shape.q) {
            (DeviceQueries::E4m3(q), Format::E4m3) => {
                check_len("q", q.len(), r * h * d)?;
                ptrs.0 = vptr(q, &s);
            }
            (DeviceQueries::E2m1 { packed, scale }, Format::E2m1) => {
                check_len("q", packed.len(), r * h * d / 2)?;
                check_len("q_scale", scale.len(), r * h * g)?;
                ptrs = (vptr(packed, &s), vptr(scale, &s));
            }
            _ => {
                return Err(Error::range(
                    "q",
                    "the other format",
                    "queries of DecodeShape::q's format",
                ))
            }
        }
        check_len("weights", inputs.weights.len(), r * h)?;
        check_len("context_lens", inputs.context_lens.len(), shape.batch)?;
        check_len(
            "page_table",
            inputs.page_table.len(),
            shape.batch * shape.max_pages,
        )?;
        let paging = pool_shape(
            &s,
            d,
            shape.k,
            &inputs.kv_cache,
            shape.page_size,
            shape.max_pages,
        )?;
        if inputs.kv_cache.is_empty() {
            return Err(Error::range("kv_cache", "0 bytes", "at least one page"));
        }
        let kv = vptr(&inputs.kv_cache, &s);
        // The kernels read both with 16-byte loads.
        aligned("q", ptrs.0)?;
        aligned("kv_cache", kv)?;
        check_len("raw", raw.len(), r * shape.topk)?;
        check_len("page", page.len(), r * shape.page_width())?;
        let layout = Layout::of(shape, self.dev.sm_count());
        if workspace.len() < layout.total {
            return Err(Error::range(
                "workspace",
                format!("{} bytes", workspace.len()),
                "at least Engine::decode_workspace_bytes(shape) bytes",
            ));
        }
        let (ws, _g) = workspace.device_ptr_mut(&s);
        let (raw_p, _g2) = raw.device_ptr_mut(&s);
        let (page_p, _g3) = page.device_ptr_mut(&s);
        let lg = Variant::logits(h, g, shape.q, shape.k, true, self.precision);
        // Each request's next_n rows are row groups of their own (the wide entry where
        // next_n > 4).
        let (lg_entry, lg_rows, lg_threads) =
            kernels::logits_entry(lg, self.dev.hooks(), shape.next_n, |r| {
                shape.next_n.div_ceil(r)
            });
        // Compile and configure everything now: a launch inside a graph capture does not.
        let tk = |name: &str| self.dev.function(Variant::Topk, name);
        let f = Functions {
            rows: tk("decode_rows")?,
            logits: self.dev.function(lg, lg_entry.name())?,
            segments: tk("topk_segments_f32")?,
            merge: tk("topk_merge_f32")?,
            short: tk(RowTopk::Short.name())?,
            ragged: tk(RowTopk::Ragged.name())?,
            wide: tk(RowTopk::Wide.name())?,
            cluster: tk(RowTopk::Cluster.name())?,
        };
        allow_dynamic_smem(
            &f.short,
            short_launch_smem(0, short_row_cap(shape, self.dev.hooks()) as usize) as u32,
        )?;
        allow_dynamic_smem(&f.wide, kernels::TOPK_WIDE_SMEM as u32)?;
        allow_dynamic_smem(&f.cluster, kernels::TOPK_WIDE_SMEM as u32)?;
        let logits_args = LogitsArgs {
            q: ptrs.0,
            q_scale: ptrs.1,
            k: kv,
            k_scale8: 0,
            k_scale32: 0,
            w: vptr(&inputs.weights, &s),
            row_n: ws + layout.row_n as u64,
            row_ks: ws + layout.row_ks as u64,
            row_off: ws + layout.row_off as u64,
            groups: ws + layout.groups as u64,
            group0: 0,
            logits: ws + layout.logits as u64,
            paths: ws + layout.paths as u64 + 4 * kernels::TOPK_PATHS.len() as u64,
            paged: Some((vptr(&inputs.page_table, &s), paging.page_log2)),
            predecoded: None,
            kmap: launch::key_tensor_map(
                lg_entry,
                lg,
                kv,
                inputs.kv_cache.len() as u64,
                Some(paging),
            )?,
            smem: 0,
        };
        Ok(DecodeStep {
            engine: self.clone(),
            shape: *shape,
            f,
            lg_entry,
            lg_rows,
            lg_threads,
            logits_args,
            context_lens: vptr(&inputs.context_lens, &s),
            raw: raw_p,
            page: page_p,
            ws,
            layout,
            _views: PhantomData,
        })
    }

    /// SPEC 8's checks of a decode step's values, the optional call beside
    /// [`DecodeStep::launch`]: every `context_lens[b]` in `next_n ..= max_context`, then,
    /// over the batch those lengths give, what [`Engine::run_device`] checks (the queries,
    /// the used page-table entries and the slots some request reads, the weights), with
    /// [`crate::problem::Problem::new`]'s errors. Reads `context_lens` back (one wait for
    /// the stream).
    pub fn decode_check(&self, shape: &DecodeShape, inputs: &DecodeInputs<'_>) -> Result<()> {
        check_decode_shape(shape)?;
        let s = &self.dev.stream;
        check_len("context_lens", inputs.context_lens.len(), shape.batch)?;
        let lens = s
            .clone_dtoh(&inputs.context_lens)
            .map_err(drv("copy context_lens back"))?;
        for (b, &c) in lens.iter().enumerate() {
            if c < shape.next_n as i32 || c as i64 > shape.max_context as i64 {
                return Err(Error::range(
                    format!("context_lens[{b}]"),
                    c,
                    "next_n ..= max_context (DecodeShape)",
                ));
            }
        }
        let seq: Vec<usize> = lens.iter().map(|&c| c as usize).collect();
        let q0: Vec<usize> = seq.iter().map(|&c| c - shape.next_n).collect();
        let batch = Batch::contiguous(&seq, &q0, shape.ratio)?;
        let q = match &inputs.q {
            DeviceQueries::E4m3(q) => DeviceQueries::E4m3(q.slice(..)),
            DeviceQueries::E2m1 { packed, scale } => DeviceQueries::E2m1 {
                packed: packed.slice(..),
                scale: scale.slice(..),
            },
        };
        let di = DeviceInputs {
            heads: shape.heads,
            dim: shape.dim,
            q,
            k: DeviceKeys::Paged {
                format: shape.k,
                kv_cache: inputs.kv_cache.slice(..),
                page_table: inputs.page_table.slice(..),
                max_pages: shape.max_pages,
                page_size: shape.page_size,
            },
            weights: inputs.weights.slice(..),
            k_slots: None,
        };
        let pg = paged_shapes(
            s,
            &batch,
            shape.dim,
            shape.k,
            &inputs.kv_cache,
            &inputs.page_table,
            shape.max_pages,
            shape.page_size,
        )?;
        validate_values(&self.dev, &Space::Own, &batch, &di, Some(pg)).map(drop)
    }
}

/// What the decode kernels support, from the shape alone.
fn check_decode_shape(shape: &DecodeShape) -> Result<()> {
    let h = shape.heads;
    if !(h.is_power_of_two() && (8..=64).contains(&h)) {
        return Err(Error::range("heads", h, "a power of two in 8..=64"));
    }
    if ![32, 64, 128].contains(&shape.dim) {
        return Err(Error::range("dim", shape.dim, "32, 64 or 128"));
    }
    if shape.batch == 0 {
        return Err(Error::range("batch", 0, "at least one request"));
    }
    if !(1..=64).contains(&shape.next_n) {
        return Err(Error::range("next_n", shape.next_n, "1 ..= 64"));
    }
    if shape.ratio == 0 {
        return Err(Error::range("ratio", 0, "ratio >= 1"));
    }
    if shape.topk == 0 || shape.topk > MAX_TOPK {
        return Err(Error::range("topk", shape.topk, "1 ..= 65536"));
    }
    crate::problem::page_cols_for(shape.topk, shape.page_cols)?;
    if shape.max_context >= (1usize << 31) {
        return Err(Error::range(
            "max_context",
            shape.max_context,
            "below 2^31 tokens",
        ));
    }
    let need = shape.max_keys().div_ceil(shape.page_size.max(1));
    if shape.max_pages < need {
        return Err(Error::range(
            "max_pages",
            shape.max_pages,
            "at least ceil(max_context / r / page_size) page-table entries per request",
        ));
    }
    let rows = shape.rows();
    if rows >= (1usize << 31) || shape.batch.saturating_mul(shape.max_pages) > u32::MAX as usize {
        return Err(Error::range(
            "batch",
            shape.batch,
            "fewer than 2^31 rows and 2^32 page-table entries on the CUDA backend",
        ));
    }
    Ok(())
}

impl DecodeStep<'_> {
    /// The step's shape.
    pub fn shape(&self) -> &DecodeShape {
        &self.shape
    }

    /// Queue the step on the engine's stream: allocation-free, no synchronisation, no
    /// read of device data on the host (capturable in a CUDA graph).
    pub fn launch(&self) -> Result<()> {
        let dev = &self.engine.dev;
        let s = &dev.stream;
        let sh = &self.shape;
        let l = &self.layout;
        let rows = sh.rows() as u32;
        let gpr = sh.next_n.div_ceil(self.lg_rows);
        let ngroups = sh.batch * gpr;
        let a = &self.logits_args;
        // 1. Row metadata from context_lens (and zeroed path counters).
        {
            let (b, nn, ratio) = (sh.batch as u32, sh.next_n as u32, sh.ratio as u32);
            let max_keys = sh.max_keys() as u32;
            let (cols, stride, lgr) = (sh.max_pages as u32, l.stride as u32, self.lg_rows as u32);
            let paths = self.ws + l.paths as u64;
            let npaths = (PATHS_BYTES / 4) as u32;
            let threads = 256u32;
            let n = (rows as usize).max(ngroups).max(npaths as usize) as u32;
            let mut lb = s.launch_builder(&self.f.rows);
            lb.arg(&self.context_lens)
                .arg(&b)
                .arg(&nn)
                .arg(&ratio)
                .arg(&max_keys)
                .arg(&cols)
                .arg(&stride)
                .arg(&lgr)
                .arg(&a.row_n)
                .arg(&a.row_ks)
                .arg(&a.row_off)
                .arg(&a.groups)
                .arg(&paths)
                .arg(&npaths);
            // SAFETY: thread i writes row i's metadata (i < B * next_n), group i's
            // (i < B * ceil(next_n / lg_rows)) and counter i (i < npaths), all inside
            // the workspace regions Layout sized; it reads context_lens[0 .. B).
            unsafe {
                lb.launch(LaunchConfig {
                    grid_dim: (n.div_ceil(threads), 1, 1),
                    block_dim: (threads, 1, 1),
                    shared_mem_bytes: 0,
                })
            }
            .map_err(drv("launch decode_rows"))?;
        }
        // 2. Logits: every request's key tiles across blocks.
        let chunks = sh.max_keys().div_ceil(kernels::LOGITS_KEYS);
        if chunks > 0 {
            let per_block = kernels::logits_launch_tiles_per_block(
                self.lg_entry,
                chunks,
                ngroups,
                dev.sm_count(),
            );
            let gx = chunks.div_ceil(per_block) as u32;
            launch::logits(s, &self.f.logits, a, 0..ngroups, gx, self.lg_threads as u32)?;
        }
        // 3. Top-k: raw, and page through the page table.
        let k = sh.topk as u32;
        let page_cols = sh.page_width() as u32;
        let (table, page_log2) = a.paged.unwrap_or((0, 0));
        let slots = SlotTable { table, page_log2 };
        let tk_paths = self.ws + l.paths as u64;
        if l.segments > 1 {
            let args = TopkSegmentsArgs {
                logits: a.logits,
                row_off: a.row_off,
                row_n: a.row_n,
                row0: 0,
                k,
                scratch: self.ws + l.split as u64,
                cblocks: 0,
                num_blocks: 1,
                block_size: 1,
                bitmap_words: 0,
                paths: tk_paths,
            };
            launch::topk_segments(s, &self.f.segments, &args, l.segments as u32, rows, 0)?;
            let args = TopkMergeArgs {
                row_ks: a.row_ks,
                row0: 0,
                k,
                segments: l.segments as u32,
                scratch: self.ws + l.split as u64,
                raw: self.raw,
                page: self.page,
                page_cols,
                slots,
                paths: tk_paths,
            };
            launch::topk_merge(s, &self.f.merge, &args, rows)?;
        } else {
            // Row lengths are on the device: the shared-memory row takes rows of up to
            // the longest context's keys (or its cap), the passes over global memory
            // the rest (topk_ragged_wide_f32 when the rows fit one wave of it); each
            // block returns at once on a row of the other launch.
            let row_cap = short_row_cap(sh, dev.hooks());
            let mut launches = Vec::with_capacity(2);
            if row_cap > 0 {
                let smem = short_launch_smem(0, row_cap as usize) as u32;
                launches.push((&self.f.short, RowTopk::Short, row_cap, smem));
            }
            if row_cap == 0 || sh.max_keys() > row_cap as usize {
                let n_min = if row_cap > 0 { row_cap + 1 } else { 0 };
                let (entry, smem) = long_rows_launch(rows as usize, 0, dev.sm_count(), dev.hooks());
                launches.push((self.f.row_topk(entry), entry, n_min, smem));
            }
            for (f, entry, bound, smem) in launches {
                let args = TopkRowsArgs {
                    logits: a.logits,
                    row_off: a.row_off,
                    row_n: a.row_n,
                    row_ks: a.row_ks,
                    row0: 0,
                    k,
                    raw: self.raw,
                    page: self.page,
                    page_cols,
                    slots,
                    cblocks: 0,
                    num_blocks: 1,
                    block_size: 1,
                    bitmap_words: 0,
                    row_bound: bound,
                    paths: tk_paths,
                };
                launch::topk_rows(s, f, entry, &args, rows, smem)?;
            }
        }
        Ok(())
    }
}

/// The median time (ms, CUDA events, `reps` launches after one warm-up) of the decode
/// step of paged problem `p` (a contiguous batch of `next_n` rows per request) on
/// `dev`, bound to `up`, the CUDA backend's uploads of `p`'s inputs (its queries, weights,
/// pool and page table: nothing is uploaded twice), its `context_lens`, outputs and
/// workspace allocated once. The benchmark's figure of the engine entry.
pub(super) fn time_step(
    dev: &std::sync::Arc<super::device::Device>,
    precision: kernels::Precision,
    p: &crate::problem::Problem,
    up: &super::run::Uploads,
    next_n: usize,
    reps: usize,
) -> Result<f64> {
    use crate::problem::Keys;
    let Keys::Paged(pk) = p.inputs.k else {
        return Err(super::backend_err("the decode step takes paged keys"));
    };
    let s = dev.stream.clone();
    let seq = p.batch.seq_lens();
    let shape = DecodeShape {
        batch: seq.len(),
        next_n,
        max_context: seq.iter().copied().max().unwrap_or(0),
        heads: p.heads,
        dim: p.dim,
        q: p.q_format(),
        k: pk.format,
        topk: p.topk,
        page_cols: Some(p.page_cols),
        page_size: pk.page_size,
        max_pages: pk.page_table.ncols(),
        ratio: p.batch.ratio(),
    };
    // Every input but context_lens is the backend's (the pool only where its kernels read
    // the pages in place, as the decode step does).
    let missing = |what: &str| {
        super::backend_err(format!(
            "the decode step's {what}: not among the CUDA backend's uploads"
        ))
    };
    let q = up.q.as_ref().ok_or_else(|| missing("q"))?;
    let w = up.w.as_ref().ok_or_else(|| missing("weights"))?;
    let kv = up.k.as_ref().ok_or_else(|| missing("kv_cache"))?;
    let table = up
        .page_table
        .as_ref()
        .ok_or_else(|| missing("page_table"))?;
    use super::alloc::Fill;
    let ctx: Vec<i32> = seq.iter().map(|&c| c as i32).collect();
    let ctx = dev
        .allocate(Fill::Host(&ctx))
        .map_err(drv("upload context_lens"))?;
    let zeros = |n: usize, what: &str| dev.allocate::<i32>(Fill::Zeros(n)).map_err(drv(what));
    let mut raw = zeros(shape.rows() * shape.topk, "alloc raw")?;
    let mut page = zeros(shape.rows() * shape.page_width(), "alloc page")?;
    let engine = Engine::on_device(dev.clone()).with_precision(precision);
    let mut ws = dev
        .allocate::<u8>(Fill::Zeros(engine.decode_workspace_bytes(&shape)))
        .map_err(drv("alloc decode workspace"))?;
    let inputs = DecodeInputs {
        q: match shape.q {
            Format::E4m3 => DeviceQueries::E4m3(q.as_view()),
            Format::E2m1 => DeviceQueries::E2m1 {
                packed: q.as_view(),
                scale: up
                    .q_scale
                    .as_ref()
                    .ok_or_else(|| missing("q_scale"))?
                    .as_view(),
            },
        },
        weights: w.as_view(),
        kv_cache: kv.as_view(),
        page_table: table.as_view(),
        context_lens: ctx.as_view(),
    };
    let (mut rv, mut pv, mut wv) = (raw.as_view_mut(), page.as_view_mut(), ws.as_view_mut());
    let step = engine.decode_step(&shape, &inputs, &mut rv, &mut pv, &mut wv)?;
    let ev = || {
        dev.ctx
            .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(drv("create event"))
    };
    let (e0, e1) = (ev()?, ev()?);
    let mut ms = Vec::with_capacity(reps);
    for rep in 0..=reps {
        e0.record(&s).map_err(drv("record"))?;
        step.launch()?;
        e1.record(&s).map_err(drv("record"))?;
        e1.synchronize().map_err(drv("synchronize"))?;
        if rep > 0 {
            ms.push(e0.elapsed_ms(&e1).map_err(drv("elapsed"))? as f64);
        }
    }
    ms.sort_by(f64::total_cmp);
    Ok(ms.get(ms.len() / 2).copied().unwrap_or(f64::NAN))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(batch: usize, next_n: usize, max_context: usize, topk: usize) -> DecodeShape {
        DecodeShape {
            batch,
            next_n,
            max_context,
            heads: 64,
            dim: 128,
            q: Format::E4m3,
            k: Format::E4m3,
            topk,
            page_cols: None,
            page_size: 64,
            max_pages: max_context.div_ceil(64),
            ratio: 1,
        }
    }

    /// The terms sum to the workspace; the logits hold every row at the longest context
    /// (rows padded to 16 floats); the split scratch appears only for fewer rows than SMs.
    #[test]
    fn workspace_terms_sum_to_the_workspace_and_size_the_logits() {
        for (b, n, ctx, k) in [
            (128, 2, 131_072, 2048),
            (64, 1, 32_768, 2048),
            (1, 1, 1000, 64),
            (3, 4, 40_001, 512),
        ] {
            let sh = shape(b, n, ctx, k);
            let t = decode_workspace_terms(&sh, 132);
            assert_eq!(
                t.iter().map(|x| x.1).sum::<usize>(),
                decode_workspace_bytes(&sh, 132)
            );
            let logits = 4 * b * n * ctx.div_ceil(16) * 16;
            assert_eq!(t[2], ("logits", logits.div_ceil(256) * 256), "{sh:?}");
            let segs = split_segments(b * n, ctx, k, 132);
            let scratch = if segs > 1 { 8 * b * n * segs * k } else { 0 };
            assert_eq!(
                t[3],
                ("split_topk_scratch", scratch.div_ceil(256) * 256),
                "{sh:?}"
            );
            assert!(t.iter().all(|x| x.1 % 256 == 0));
        }
    }

    /// Shapes the decode kernels do not take are errors naming the field.
    #[test]
    fn decode_shape_errors_name_the_field() {
        let ok = shape(4, 2, 1000, 64);
        assert!(check_decode_shape(&ok).is_ok());
        let cases: [(DecodeShape, &str); 6] = [
            (DecodeShape { heads: 12, ..ok }, "heads = 12"),
            (DecodeShape { next_n: 0, ..ok }, "next_n = 0"),
            (DecodeShape { batch: 0, ..ok }, "batch = 0"),
            (DecodeShape { topk: 0, ..ok }, "topk = 0"),
            (
                DecodeShape {
                    page_cols: Some(8),
                    ..ok
                },
                "page_cols = 8",
            ),
            (
                DecodeShape {
                    max_pages: 15,
                    ..ok
                },
                "max_pages = 15",
            ),
        ];
        for (sh, want) in cases {
            let e = check_decode_shape(&sh).unwrap_err().to_string();
            assert!(e.starts_with(want), "{e}");
        }
    }
}
