//! The CUDA backend (feature `cuda`): the chunked driver's [`Backend`] on NVIDIA Hopper.
//!
//! Kernels (`kernels/*.cu`) are compiled at run time by NVRTC for `sm_90a` and cached per
//! process ([`kernels`]). Per tile, everything runs on one stream with no host round
//! trip: the logits kernel (tensor-core MMA, SPEC 4 bitwise in the exact class), for a
//! source layer the block keys and kept blocks, then the ragged top-k with index
//! assembly writing `raw` and `page` in place on the device. The host copies back only
//! the outputs, once, in [`Backend::end`].
//!
//! Device memory: inputs and outputs are uploaded / allocated once per run; the
//! transient (logits tile, block keys, per-row metadata, and for tiles of few rows the
//! split top-k's segment ids) is allocated once per run, sized by the plan with this
//! backend's footprint (rows padded to [`ROW_ALIGN`] floats; metadata and split scratch
//! as the per-worker operand term), reused by every tile, and counted:
//! [`CudaBackend::measured_peak`] never exceeds the plan's peak (a GPU test).
//!
//! Classes: the exact class (E2M1 x E2M1) is bitwise the reference; the tolerance class
//! meets `|x - ref| <= 2^e * M + A`, with `e` = [`TOLERANCE_LOG2`] = -16 on every kernel
//! the backend runs by default (they add products in f32), `A` the absolute term of f32
//! rounding in the subnormal range ([`tolerance_abs_term`]; all together:
//! [`logit_bound`]). The fp8 `wgmma` kernel behind the `W8=1` knob is held to SPEC 4's
//! `2^-8` instead and misses it on subnormal operands ([`FP8_WGMMA_TOLERANCE_LOG2`]).
//! Given the same scores,
//! selections are bitwise the reference's. NaN logits are written as the reference's
//! NaN (`0xFFC00000`).
//!
//! Engines that already hold their inputs on the device call [`Engine::run_device`]
//! with cudarc views and their own stream. Their values are checked on the device
//! (`kernels/validate.cu`) with the errors [`Problem::new`] gives for the same host
//! arrays (SPEC 8).
//!
//! Without libcuda, libnvrtc or a GPU every entry point returns [`Error::Backend`];
//! a GPU other than sm_90 is refused with a clear message.

mod backend;
pub mod bench;
mod device;
mod engine;
mod geometry;
pub mod kernels;
mod paths;
mod tolerance;
mod validate;

use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};

use crate::batch::Batch;
use crate::error::Result;
use crate::plan::{Footprint, Plan};

pub use backend::{run_cuda, CudaBackend};
use device::{backend_err, drv, ptr};
pub use device::{libraries_present, DecodedCodes, Device};
pub use engine::{DeviceInputs, DeviceKeys, DeviceOutput, DeviceQueries, Engine, INPUT_ALIGN};
use geometry::{
    footprint, short_launch_smem, short_row_cap, split_segments, Shape, TileGeom, PATHS_BYTES,
};
pub use geometry::{MAX_TOPK, ROW_ALIGN};
pub use kernels::Variant;
pub use paths::{FoldCounts, TopkPaths};
pub use tolerance::{
    is_bitwise, logit_bound, tolerance_abs_term, tolerance_bound, tolerance_log2,
    F32_SUBNORMAL_ULP, FP8_WGMMA_TOLERANCE_LOG2, TOLERANCE_LOG2,
};

// ---------------------------------------------------------------------------------
// The run: device pointers of the inputs, metadata, transient and outputs.
// ---------------------------------------------------------------------------------

/// Raw device addresses of a run's inputs (0 = absent).
#[derive(Debug, Clone, Copy, Default)]
struct Ptrs {
    q: u64,
    q_scale: u64,
    k: u64,
    k_scale8: u64,
    k_scale32: u64,
    w: u64,
    k_slots: u64,
    cblocks: u64,
}

/// One run's device state.
struct Run {
    shape: Shape,
    ptrs: Ptrs,
    // Metadata (transient, counted).
    row_n: CudaSlice<u32>,
    row_ks: CudaSlice<u32>,
    row_off: CudaSlice<u64>,
    row_pub: CudaSlice<i32>,
    row_boff: CudaSlice<u64>,
    groups: CudaSlice<u32>,
    logits: Option<CudaSlice<f32>>,
    bkeys: Option<CudaSlice<u32>>,
    split: Option<CudaSlice<i32>>,
    geom: Vec<TileGeom>,
    // Outputs.
    raw: CudaSlice<i32>,
    page: CudaSlice<i32>,
    published: Option<CudaSlice<i32>>,
    /// Path counters: the top-k's (`kernels::TOPK_PATHS`), then the logits kernels'
    /// (`kernels::LOGITS_PATHS`).
    paths: CudaSlice<u32>,
    // Host-input uploads kept alive for the run (not transient).
    _owned: Vec<OwnedBuf>,
    transient: usize,
    bitmap_words: u32,
}

/// The device addresses of a run's buffers (0 = absent), taken once per step for the
/// kernel arguments of both halves of a tile.
#[derive(Debug, Clone, Copy)]
struct RunAddrs {
    logits: u64,
    row_n: u64,
    row_ks: u64,
    row_off: u64,
    row_pub: u64,
    row_boff: u64,
    groups: u64,
    bkeys: u64,
    split: u64,
    raw: u64,
    page: u64,
    published: u64,
    paths: u64,
}

impl Run {
    fn addrs(&self, s: &CudaStream) -> RunAddrs {
        let opt = |b: &Option<CudaSlice<_>>| b.as_ref().map_or(0, |b| ptr(b, s));
        RunAddrs {
            logits: self.logits.as_ref().map_or(0, |l| ptr(l, s)),
            row_n: ptr(&self.row_n, s),
            row_ks: ptr(&self.row_ks, s),
            row_off: ptr(&self.row_off, s),
            row_pub: ptr(&self.row_pub, s),
            row_boff: ptr(&self.row_boff, s),
            groups: ptr(&self.groups, s),
            bkeys: self.bkeys.as_ref().map_or(0, |b| ptr(b, s)),
            split: opt(&self.split),
            raw: ptr(&self.raw, s),
            page: ptr(&self.page, s),
            published: opt(&self.published),
            paths: ptr(&self.paths, s),
        }
    }
}

/// Raise `f`'s dynamic shared-memory limit to `bytes` (a consumer row's bitmap on top of
/// the top-k kernels' static 42 KiB exceeds the default 48 KiB); nothing for 0.
fn allow_dynamic_smem(f: &CudaFunction, bytes: u32) -> Result<()> {
    if bytes > 0 {
        f.set_attribute(
            cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes as i32,
        )
        .map_err(drv("set shared memory size"))?;
    }
    Ok(())
}

#[allow(dead_code)]
enum OwnedBuf {
    U8(CudaSlice<u8>),
    F32(CudaSlice<f32>),
    I32(CudaSlice<i32>),
}

impl Run {
    #[allow(clippy::too_many_arguments)]
    fn begin(
        dev: &Device,
        batch: &Batch,
        shape: Shape,
        ptrs: Ptrs,
        owned: Vec<OwnedBuf>,
        plan: &Plan,
        publishes: &dyn Fn(usize) -> bool,
    ) -> Result<Run> {
        let s = &dev.stream;
        let rows = batch.rows();
        let t = rows.len();
        let fp = footprint(t, shape.topk);
        let mut row_n = Vec::with_capacity(t);
        let mut row_ks = Vec::with_capacity(t);
        let mut row_off = vec![0u64; t];
        let mut row_pub = vec![-1i32; t];
        let mut row_boff = vec![0u64; t];
        let mut groups: Vec<u32> = Vec::new();
        let mut geom = Vec::with_capacity(plan.tiles.len());
        let mut npub = 0i32;
        let (_, lg_rows, _) = kernels::logits_kernel(shape.logits_variant());
        for r in rows {
            row_n.push(r.n as u32);
            row_ks.push(r.ks as u32);
        }
        // A consumer row's bitmap of kept blocks, then (from a 16-byte boundary) the
        // shared-memory row: the top-k launch's dynamic shared memory.
        let longest = rows.iter().map(|r| r.n).max().unwrap_or(0);
        let bitmap_words = if shape.consumer {
            longest.div_ceil(shape.block_size).div_ceil(32).max(1) as u32
        } else {
            0
        };
        for tile in &plan.tiles {
            let (mut off, mut boff) = (0u64, 0u64);
            let g0 = groups.len() / 4;
            let (mut max_n, mut max_blocks) = (0usize, 0usize);
            let mut i = tile.rows.start;
            while i < tile.rows.end {
                // A row group: up to one logits block's rows, consecutive, of one request.
                let mut e = i + 1;
                while e < tile.rows.end
                    && e - i < lg_rows
                    && rows[e].ks == rows[i].ks
                    && rows[e].request == rows[i].request
                {
                    e += 1;
                }
                let nmax = rows[i..e].iter().map(|r| r.n).max().unwrap_or(0);
                groups.extend_from_slice(&[i as u32, (e - i) as u32, nmax as u32, 0]);
                max_n = max_n.max(nmax);
                i = e;
            }
            let short_cap = short_row_cap(
                rows[tile.rows.clone()].iter().map(|r| r.n),
                shape.topk,
                kernels::topk_short_cap(),
                bitmap_words,
            );
            for i in tile.rows.clone() {
                row_off[i] = off;
                off += (fp.row_bytes(rows[i].n) / 4) as u64;
                if publishes(i) {
                    row_pub[i] = npub;
                    npub += 1;
                    row_boff[i] = boff;
                    let nb = rows[i].n.div_ceil(shape.block_size);
                    boff += nb as u64;
                    max_blocks = max_blocks.max(nb);
                }
            }
            geom.push(TileGeom {
                groups: g0..groups.len() / 4,
                chunks: max_n.div_ceil(kernels::LOGITS_KEYS) as u32,
                max_blocks,
                rows: tile.rows.clone(),
                segments: split_segments(tile.rows.len(), max_n, shape.topk),
                short_cap,
                max_n,
            });
        }
        let up = |what: &str, e| drv(what)(e);
        let mut transient = 0usize;
        let row_n_d = s.clone_htod(&row_n).map_err(|e| up("upload row_n", e))?;
        let row_ks_d = s.clone_htod(&row_ks).map_err(|e| up("upload row_ks", e))?;
        let row_off_d = s
            .clone_htod(&row_off)
            .map_err(|e| up("upload row_off", e))?;
        let row_pub_d = s
            .clone_htod(&row_pub)
            .map_err(|e| up("upload row_pub", e))?;
        let row_boff_d = s
            .clone_htod(&row_boff)
            .map_err(|e| up("upload row_boff", e))?;
        let groups_d = s.clone_htod(&groups).map_err(|e| up("upload groups", e))?;
        transient += t * (4 + 4 + 8 + 4 + 8) + groups.len() * 4;
        let logits = if plan.peak.logits_tile > 0 {
            transient += plan.peak.logits_tile;
            Some(
                s.alloc_zeros::<f32>(plan.peak.logits_tile / 4)
                    .map_err(drv("alloc logits tile"))?,
            )
        } else {
            None
        };
        let bkeys = if plan.peak.block_scores > 0 {
            transient += plan.peak.block_scores;
            Some(
                s.alloc_zeros::<u32>(plan.peak.block_scores / 4)
                    .map_err(drv("alloc block keys"))?,
            )
        } else {
            None
        };
        let split_ids = geom
            .iter()
            .map(|g| {
                if g.segments > 1 {
                    g.rows.len() * g.segments * shape.topk
                } else {
                    0
                }
            })
            .max()
            .unwrap_or(0);
        let split = if split_ids > 0 {
            transient += split_ids * 4;
            Some(
                s.alloc_zeros::<i32>(split_ids)
                    .map_err(drv("alloc split top-k scratch"))?,
            )
        } else {
            None
        };
        let raw = s
            .alloc_zeros::<i32>(t * shape.topk)
            .map_err(drv("alloc raw"))?;
        let page = s
            .alloc_zeros::<i32>(t * shape.page_cols)
            .map_err(drv("alloc page"))?;
        let published = if shape.tail.is_some() {
            Some(
                s.alloc_zeros::<i32>((npub as usize).max(1) * shape.num_blocks)
                    .map_err(drv("alloc published"))?,
            )
        } else {
            None
        };
        let paths = s
            .alloc_zeros::<u32>(PATHS_BYTES / 4)
            .map_err(drv("alloc path counters"))?;
        transient += PATHS_BYTES;
        Ok(Run {
            shape,
            ptrs,
            row_n: row_n_d,
            row_ks: row_ks_d,
            row_off: row_off_d,
            row_pub: row_pub_d,
            row_boff: row_boff_d,
            groups: groups_d,
            logits,
            bkeys,
            split,
            geom,
            raw,
            page,
            published,
            paths,
            _owned: owned,
            transient,
            bitmap_words,
        })
    }

    /// Launch tile `t`: logits, (source) block keys and kept blocks, top-k + assembly.
    fn tile(&mut self, dev: &Device, t: usize) -> Result<()> {
        self.logits_step(dev, t)?;
        self.select_step(dev, t)
    }

    /// The logits kernel of tile `t`.
    fn logits_step(&mut self, dev: &Device, t: usize) -> Result<()> {
        let g = self.geom[t].clone();
        if g.rows.is_empty() {
            return Ok(());
        }
        let s = &dev.stream;
        let sh = self.shape;
        let p = self.ptrs;
        let a = self.addrs(s);
        // 1. Logits.
        if g.chunks > 0 && a.logits != 0 {
            let (name, _, threads) = kernels::logits_kernel(sh.logits_variant());
            let f = dev.function(sh.logits_variant(), name)?;
            // Key tiles per block: enough blocks to fill the GPU several times over, and
            // up to kernels::logits_tiles_per_block() tiles per block so the query
            // fragments are loaded once per that many.
            let ngroups = g.groups.len().max(1);
            let per_block = (g.chunks as usize * ngroups / (8 * 132))
                .clamp(1, kernels::logits_tiles_per_block());
            let gx = (g.chunks as usize).div_ceil(per_block) as u32;
            let lpaths = a.paths + 4 * kernels::TOPK_PATHS.len() as u64;
            let mut start = g.groups.start;
            while start < g.groups.end {
                let count = (g.groups.end - start).min(65535);
                let group0 = start as u32;
                let mut l = s.launch_builder(&f);
                l.arg(&p.q)
                    .arg(&p.q_scale)
                    .arg(&p.k)
                    .arg(&p.k_scale8)
                    .arg(&p.k_scale32)
                    .arg(&p.w)
                    .arg(&a.row_n)
                    .arg(&a.row_ks)
                    .arg(&a.row_off)
                    .arg(&a.groups)
                    .arg(&group0)
                    .arg(&a.logits)
                    .arg(&lpaths);
                // SAFETY: every pointer addresses a live device buffer of the shape the
                // kernel reads (validated problem); writes stay inside each row's
                // footprint in the logits tile, which the plan sized.
                unsafe {
                    l.launch(LaunchConfig {
                        grid_dim: (gx, count as u32, 1),
                        block_dim: (threads as u32, 1, 1),
                        shared_mem_bytes: 0,
                    })
                }
                .map_err(drv("launch mqa_logits"))?;
                start += count;
            }
        }
        Ok(())
    }

    /// Candidate blocks, top-k and index assembly of tile `t` from its logits buffer.
    fn select_step(&mut self, dev: &Device, t: usize) -> Result<()> {
        let g = self.geom[t].clone();
        if g.rows.is_empty() {
            return Ok(());
        }
        let s = &dev.stream;
        let sh = self.shape;
        let p = self.ptrs;
        let a = self.addrs(s);
        let rows = g.rows.len() as u32;
        let row0 = g.rows.start as u32;
        // 2. Source: block keys, then kept blocks.
        if a.published != 0 && sh.tail.is_some() {
            let pub_ptr = a.published;
            let bk = a.bkeys;
            let bs = sh.block_size as u32;
            let nbk = sh.num_blocks as u32;
            if g.max_blocks > 0 && bk != 0 && a.logits != 0 {
                let f = dev.function(Variant::Topk, "block_keys_f32")?;
                let gx = g.max_blocks.div_ceil(kernels::BLOCK_KEYS_THREADS).min(1024) as u32;
                let mut r = 0u32;
                while r < rows {
                    let count = (rows - r).min(65535);
                    let r0 = row0 + r;
                    let mut l = s.launch_builder(&f);
                    l.arg(&a.logits)
                        .arg(&a.row_off)
                        .arg(&a.row_n)
                        .arg(&a.row_pub)
                        .arg(&a.row_boff)
                        .arg(&r0)
                        .arg(&bs)
                        .arg(&bk);
                    // SAFETY: reads each publishing row's n logits, writes its
                    // ceil(n/B) block keys at its offset in the plan-sized buffer.
                    unsafe {
                        l.launch(LaunchConfig {
                            grid_dim: (gx, count, 1),
                            block_dim: (kernels::BLOCK_KEYS_THREADS as u32, 1, 1),
                            shared_mem_bytes: 0,
                        })
                    }
                    .map_err(drv("launch block_keys_f32"))?;
                    r += count;
                }
            }
            let f = dev.function(Variant::Topk, "kept_blocks_u32")?;
            let mut l = s.launch_builder(&f);
            l.arg(&bk)
                .arg(&a.row_n)
                .arg(&a.row_pub)
                .arg(&a.row_boff)
                .arg(&row0)
                .arg(&bs)
                .arg(&nbk)
                .arg(&pub_ptr);
            // SAFETY: publishing rows read their block keys and write their NB-wide
            // published row; rows with no blocks write only -1.
            unsafe {
                l.launch(LaunchConfig {
                    grid_dim: (rows, 1, 1),
                    block_dim: (kernels::TOPK_THREADS as u32, 1, 1),
                    shared_mem_bytes: 0,
                })
            }
            .map_err(drv("launch kept_blocks_u32"))?;
        }
        // 3. Top-k and index assembly.
        let (raw, page) = (a.raw, a.page);
        let k = sh.topk as u32;
        let pc = sh.page_cols as u32;
        let nbk = sh.num_blocks as u32;
        let bs = sh.block_size as u32;
        let bw = self.bitmap_words;
        // A consumer row's bitmap of kept blocks (up to 160 KiB) in dynamic shared memory.
        let smem = if sh.consumer { bw * 4 } else { 0 };
        if g.segments > 1 && a.split != 0 {
            let scratch = a.split;
            let segs = g.segments as u32;
            let fs = dev.function(Variant::Topk, "topk_segments_f32")?;
            allow_dynamic_smem(&fs, smem)?;
            let mut l = s.launch_builder(&fs);
            l.arg(&a.logits)
                .arg(&a.row_off)
                .arg(&a.row_n)
                .arg(&row0)
                .arg(&k)
                .arg(&scratch)
                .arg(&p.cblocks)
                .arg(&nbk)
                .arg(&bs)
                .arg(&bw)
                .arg(&a.paths);
            // SAFETY: block (s, r) reads segment s of row r's logits and writes its K ids
            // to scratch [r, s, :], sized rows * segments * K in begin.
            unsafe {
                l.launch(LaunchConfig {
                    grid_dim: (segs, rows, 1),
                    block_dim: (kernels::TOPK_THREADS as u32, 1, 1),
                    shared_mem_bytes: smem,
                })
            }
            .map_err(drv("launch topk_segments_f32"))?;
            let fm = dev.function(Variant::Topk, "topk_merge_f32")?;
            let mut l = s.launch_builder(&fm);
            l.arg(&a.logits)
                .arg(&a.row_off)
                .arg(&a.row_ks)
                .arg(&row0)
                .arg(&k)
                .arg(&segs)
                .arg(&scratch)
                .arg(&raw)
                .arg(&page)
                .arg(&pc)
                .arg(&p.k_slots)
                .arg(&a.paths);
            // SAFETY: row r reads its S*K scratch ids (each -1 or a visible key of the
            // row) and their logits, and writes its rows of raw and page.
            unsafe {
                l.launch(LaunchConfig {
                    grid_dim: (rows, 1, 1),
                    block_dim: (kernels::TOPK_THREADS as u32, 1, 1),
                    shared_mem_bytes: 0,
                })
            }
            .map_err(drv("launch topk_merge_f32"))?;
            return Ok(());
        }
        // The tile's rows of at most short_cap keys select with the row in shared memory
        // (topk_short_f32); the longer ones with passes over global memory and more
        // blocks per SM (topk_ragged_f32, rows of at least n_min keys).
        let row_cap = g.short_cap;
        let n_min = if row_cap > 0 { row_cap + 1 } else { 0 };
        let short = (row_cap > 0).then(|| {
            let bytes = short_launch_smem(bw, row_cap as usize) as u32;
            ("topk_short_f32", row_cap, bytes)
        });
        let long = (g.max_n >= n_min as usize).then_some(("topk_ragged_f32", n_min, smem));
        for (name, bound, dyn_smem) in [short, long].into_iter().flatten() {
            let f = dev.function(Variant::Topk, name)?;
            allow_dynamic_smem(&f, dyn_smem)?;
            let mut l = s.launch_builder(&f);
            l.arg(&a.logits)
                .arg(&a.row_off)
                .arg(&a.row_n)
                .arg(&a.row_ks)
                .arg(&row0)
                .arg(&k)
                .arg(&raw)
                .arg(&page)
                .arg(&pc)
                .arg(&p.k_slots)
                .arg(&p.cblocks)
                .arg(&nbk)
                .arg(&bs)
                .arg(&bw)
                .arg(&bound)
                .arg(&a.paths);
            // SAFETY: each block reads its row's n logits (written by step 1, same
            // stream) and writes its row of raw [T, K] and page [T, page_cols];
            // topk_short_f32 takes only rows of n <= row_cap, whose keys fit the
            // shared memory this launch sizes.
            unsafe {
                l.launch(LaunchConfig {
                    grid_dim: (rows, 1, 1),
                    block_dim: (kernels::TOPK_THREADS as u32, 1, 1),
                    shared_mem_bytes: dyn_smem,
                })
            }
            .map_err(drv(name))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::Format;

    #[test]
    fn wgmma_runs_the_h32_exact_class_and_h64_e4m3_and_mma_sync_the_rest() {
        if std::env::var("DSA_CUDA_DEFINES").is_ok() {
            return; // an override changes the choice on purpose
        }
        for v in Variant::all() {
            let Variant::Logits {
                heads,
                groups,
                q,
                k,
            } = v
            else {
                continue;
            };
            let (name, rows, threads) = kernels::logits_kernel(v);
            let wg = q == Format::E2m1 && k == Format::E2m1 && heads == 32 && groups >= 2;
            let w16 = q == Format::E4m3 && k == Format::E4m3 && heads == 64;
            // The exact class keeps its keys in registers by default (WG_RS=0: shared memory).
            assert_eq!(name == "mqa_logits_wgr", wg, "{}", v.name());
            // E4M3 x E4M3 at H = 64 on f16 wgmma by default (W8=1: fp8 wgmma).
            assert_eq!(name == "mqa_logits_w16", w16, "{}", v.name());
            assert!(!kernels::logits_on_fp8_accumulator(v), "{}", v.name());
            assert_eq!(kernels::logits_wgmma(v), wg || w16, "{}", v.name());
            if wg || w16 {
                // One warpgroup per 2 rows: 2 x 32 heads = the 64 columns of its MMA, or
                // 2 x 64 heads = 128.
                assert_eq!((rows, threads), (2, 128), "{}", v.name());
            } else {
                assert_eq!(rows, kernels::logits_rows(heads), "{}", v.name());
                assert_eq!(threads, rows * 32, "{}", v.name());
            }
            // The host's choice is in the variant's source (tests/nvrtc_compile.rs checks
            // the compiled module's entries).
            assert!(v.source().contains(&format!("{name}(")), "{}", v.name());
        }
    }
}
