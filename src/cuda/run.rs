//! One run's device state and its per-tile steps: the inputs' device addresses, the
//! per-row metadata and tile geometry uploaded once, the transient buffers (logits
//! tile, block keys, split top-k scratch) allocated once and reused by every tile, and
//! the outputs, which stay on the device.

use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};

use super::alloc::{allocated_on_this_thread, Buf, Fill, Space};
use super::device::{drv, ptr, Device};
use super::geometry::{
    batch_footprint, long_rows_launch, short_launch_smem, RowMeta, RowTopk, Shape, TileGeom,
    PATHS_BYTES, SPLIT_BYTES_PER_ID,
};
use super::kernels::{self, Variant};
use super::launch::{
    self, allow_dynamic_smem, BlockKeysArgs, KeptBlocksArgs, LogitsArgs, SlotTable, TopkMergeArgs,
    TopkRowsArgs, TopkSegmentsArgs,
};
use crate::batch::Batch;
use crate::error::Result;
use crate::plan::Plan;

/// Raw device addresses of a run's inputs (0 = absent).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Ptrs {
    pub(super) q: u64,
    pub(super) q_scale: u64,
    pub(super) k: u64,
    pub(super) k_scale8: u64,
    pub(super) k_scale32: u64,
    pub(super) w: u64,
    pub(super) k_slots: u64,
    pub(super) cblocks: u64,
    /// Paged keys: the page table (`k` is then the pool).
    pub(super) page_table: u64,
    /// Bytes of `k` (the flat key codes, or the pool): what a TMA map of the keys spans.
    pub(super) k_bytes: u64,
}

/// A run's pre-decoded flat keys: `keys` keys' s8 operands (`dim` bytes each), then their
/// scale windows (4 bytes each), written by [`kernels::WGI8_DECODE_KEYS`] before the first
/// logits launch that reads them, which also encodes the operands' TMA map (`map`: none
/// until then).
struct Predecoded {
    buf: Buf<u8>,
    keys: usize,
    map: Option<launch::TensorMap>,
}

/// The stream a run of two logits slots selects on (`Shape::select`): tile
/// `t`'s selection waits for its logits on the run's stream, and the logits of the tile
/// after next, which reuse its slot, wait for that selection (`slot_free[t % 2]`). The
/// run's stream waits for the last selection after the last tile, and when the run is
/// dropped, before the run's buffers are freed in its order.
struct SelectSide {
    stream: Arc<CudaStream>,
    /// The run's stream.
    main: Arc<CudaStream>,
    /// Per slot: the end of the last selection queued from it.
    slot_free: [Option<CudaEvent>; 2],
    /// The slot of the last selection queued.
    last: Option<usize>,
}

impl SelectSide {
    /// A stream of `priority` in the context of `dev`'s stream.
    fn new(dev: &Device, priority: kernels::SelectStream) -> Result<SelectSide> {
        let ctx = dev.stream.context();
        let stream = match priority {
            kernels::SelectStream::Default => ctx.new_stream(),
            kernels::SelectStream::Greatest => {
                let (_, greatest) = cudarc::driver::result::stream::get_priority_range()
                    .map_err(drv("stream priority range"))?;
                ctx.new_stream_with_priority(greatest)
            }
        }
        .map_err(drv("create the selection stream"))?;
        Ok(SelectSide {
            stream,
            main: dev.stream.clone(),
            slot_free: [None, None],
            last: None,
        })
    }

    /// The run's stream waits for every selection queued so far.
    fn join(&self) -> Result<()> {
        if let Some(e) = self.last.and_then(|s| self.slot_free[s].as_ref()) {
            self.main
                .wait(e)
                .map_err(drv("join the selection stream"))?;
        }
        Ok(())
    }
}

impl Drop for SelectSide {
    fn drop(&mut self) {
        // Declared first in Run, so dropped before its buffers: their frees, queued on
        // the run's stream, then follow every selection that reads them.
        let _ = self.join();
    }
}

/// One run's device state.
pub(super) struct Run {
    /// The selection's own stream, in a run of two logits slots that has one. First, so
    /// that it is dropped before the buffers its selections read.
    side: Option<SelectSide>,
    /// Tiles whose logits are held at once ([`Plan::logits_slots`]), and the f32
    /// elements of each slot: tile `t`'s logits start `(t % slots) * slot_elems` into
    /// the buffer.
    slots: usize,
    slot_elems: u64,
    shape: Shape,
    ptrs: Ptrs,
    /// Per-row metadata (transient, counted).
    meta: MetaBufs,
    pub(super) logits: Option<Buf<f32>>,
    bkeys: Option<Buf<u32>>,
    split: Option<Buf<i32>>,
    /// Pre-decoded flat keys, if the run has them.
    keys8: Option<Predecoded>,
    geom: Vec<TileGeom>,
    // Outputs.
    pub(super) raw: Buf<i32>,
    pub(super) page: Buf<i32>,
    pub(super) published: Option<Buf<i32>>,
    /// Path counters: the top-k's (`kernels::TOPK_PATHS`), then the logits kernels'
    /// (`kernels::LOGITS_PATHS`).
    pub(super) paths: Buf<u32>,
    /// Host-input uploads kept alive for the run (not transient).
    uploads: Uploads,
    /// Device bytes of the transient buffers, as `Device::allocate` counted them (or
    /// as the caller's workspace holds them).
    pub(super) transient: usize,
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
        fn opt<T>(b: &Option<Buf<T>>, s: &CudaStream) -> u64 {
            b.as_ref().map_or(0, |b| b.addr(s))
        }
        RunAddrs {
            logits: opt(&self.logits, s),
            row_n: self.meta.row_n.addr(s),
            row_ks: self.meta.row_ks.addr(s),
            row_off: self.meta.row_off.addr(s),
            row_pub: self.meta.row_pub.addr(s),
            row_boff: self.meta.row_boff.addr(s),
            groups: self.meta.groups.addr(s),
            bkeys: opt(&self.bkeys, s),
            split: opt(&self.split, s),
            raw: self.raw.addr(s),
            page: self.page.addr(s),
            published: opt(&self.published, s),
            paths: self.paths.addr(s),
        }
    }
}

/// The device copies of a run's host inputs ([`super::CudaBackend`]'s runs; none for
/// the engine entry, whose inputs are the caller's views), each absent where the layer
/// has no such input. Kept alive by the run, not counted as transient.
#[derive(Default)]
pub(super) struct Uploads {
    /// E4M3 query codes, or packed E2M1 queries.
    pub(super) q: Option<CudaSlice<u8>>,
    /// UE8M0 query scales (E2M1 queries).
    pub(super) q_scale: Option<CudaSlice<u8>>,
    /// Flat key codes (E4M3, or packed E2M1), or the page pool of paged keys.
    pub(super) k: Option<CudaSlice<u8>>,
    /// UE8M0 key scales (flat E2M1 keys).
    pub(super) k_scale8: Option<CudaSlice<u8>>,
    /// f32 key scales (flat E4M3 keys).
    pub(super) k_scale32: Option<CudaSlice<f32>>,
    /// The page table (paged keys).
    pub(super) page_table: Option<CudaSlice<i32>>,
    /// Weights.
    pub(super) w: Option<CudaSlice<f32>>,
    /// Pool slots of flat keys.
    pub(super) k_slots: Option<CudaSlice<i32>>,
    /// A consumer's candidate blocks.
    pub(super) cblocks: Option<CudaSlice<i32>>,
}

impl Uploads {
    /// The kernels' view of these buffers: their device addresses, 0 for an absent one.
    pub(super) fn ptrs(&self, s: &CudaStream) -> Ptrs {
        fn at<T>(b: &Option<CudaSlice<T>>, s: &CudaStream) -> u64 {
            b.as_ref().map_or(0, |b| ptr(b, s))
        }
        Ptrs {
            q: at(&self.q, s),
            q_scale: at(&self.q_scale, s),
            k: at(&self.k, s),
            k_scale8: at(&self.k_scale8, s),
            k_scale32: at(&self.k_scale32, s),
            w: at(&self.w, s),
            k_slots: at(&self.k_slots, s),
            cblocks: at(&self.cblocks, s),
            page_table: at(&self.page_table, s),
            k_bytes: self.k.as_ref().map_or(0, |b| b.len() as u64),
        }
    }
}

/// A run's per-row metadata on the device (transient, counted).
struct MetaBufs {
    row_n: Buf<u32>,
    row_ks: Buf<u32>,
    row_off: Buf<u64>,
    row_pub: Buf<i32>,
    row_boff: Buf<u64>,
    groups: Buf<u32>,
}

impl MetaBufs {
    /// Upload `meta`'s per-row arrays and row groups into `space`.
    fn upload(dev: &Device, space: &mut Space, meta: &RowMeta) -> Result<MetaBufs> {
        Ok(MetaBufs {
            row_n: upload(dev, space, "row_n", &meta.row_n)?,
            row_ks: upload(dev, space, "row_ks", &meta.row_ks)?,
            row_off: upload(dev, space, "row_off", &meta.row_off)?,
            row_pub: upload(dev, space, "row_pub", &meta.row_pub)?,
            row_boff: upload(dev, space, "row_boff", &meta.row_boff)?,
            groups: upload(dev, space, "groups", &meta.groups)?,
        })
    }
}

/// One host array on the device, in `space`, an upload error naming it (`upload row_n`).
fn upload<T: DeviceRepr + ValidAsZeroBits>(
    dev: &Device,
    space: &mut Space,
    what: &str,
    host: &[T],
) -> Result<Buf<T>> {
    dev.buffer(space, Fill::Host(host), &format!("upload {what}"))
}

/// A run's transient buffers, reused by every tile: the logits tile, the block keys,
/// the split top-k's scratch and the pre-decoded keys (each absent when the run needs
/// none).
struct TransientBufs {
    logits: Option<Buf<f32>>,
    bkeys: Option<Buf<u32>>,
    split: Option<Buf<i32>>,
    keys8: Option<Buf<u8>>,
}

impl TransientBufs {
    /// Allocate the plan's logits tile and block keys, the scratch of the tile of
    /// `geom` that splits the most ids and `keys8` bytes of pre-decoded keys, in `space`.
    fn alloc(
        dev: &Device,
        space: &mut Space,
        plan: &Plan,
        geom: &[TileGeom],
        topk: usize,
        keys8: usize,
    ) -> Result<TransientBufs> {
        let logits = if plan.peak.logits_tile > 0 {
            Some(dev.buffer::<f32>(
                space,
                Fill::Zeros(plan.peak.logits_tile / 4),
                "alloc logits tile",
            )?)
        } else {
            None
        };
        let bkeys = if plan.peak.block_scores > 0 {
            Some(dev.buffer::<u32>(
                space,
                Fill::Zeros(plan.peak.block_scores / 4),
                "alloc block keys",
            )?)
        } else {
            None
        };
        let split_ids = geom
            .iter()
            .map(|g| {
                if g.segments > 1 {
                    g.rows.len() * g.segments * topk
                } else {
                    0
                }
            })
            .max()
            .unwrap_or(0);
        let split = if split_ids > 0 {
            Some(dev.buffer::<i32>(
                space,
                Fill::Zeros(split_ids * SPLIT_BYTES_PER_ID / 4),
                "alloc split top-k scratch",
            )?)
        } else {
            None
        };
        let keys8 = if keys8 > 0 {
            Some(dev.buffer::<u8>(space, Fill::Zeros(keys8), "alloc pre-decoded keys")?)
        } else {
            None
        };
        Ok(TransientBufs {
            logits,
            bkeys,
            split,
            keys8,
        })
    }
}

/// A run's outputs on the device.
struct OutputBufs {
    raw: Buf<i32>,
    page: Buf<i32>,
    published: Option<Buf<i32>>,
}

/// Where a run writes its outputs.
#[derive(Debug, Clone, Copy)]
pub(super) enum OutPlace {
    /// Buffers of its own ([`Device::allocate`]), all zero.
    Own,
    /// The caller's `raw [t, K]`, `page [t, page_cols]` and, for a source layer,
    /// `published [npub, NB]` (0: none) at these device addresses, zeroed first in
    /// stream order as the run's own would be.
    At { raw: u64, page: u64, published: u64 },
}

impl OutputBufs {
    /// `raw [t, K]`, `page [t, page_cols]`, for a source layer the `npub` published
    /// rows, all zero, at `place` (nothing written when `measuring`): allocated ones
    /// hold at least one published row.
    fn alloc(
        dev: &Device,
        place: OutPlace,
        measuring: bool,
        t: usize,
        shape: &Shape,
        npub: i32,
    ) -> Result<OutputBufs> {
        let lens = shape.output_lens(t, npub.max(0) as usize);
        match place {
            OutPlace::Own => {
                let mut own = Space::Own;
                let mut zeros =
                    |n: usize, what: &str| dev.buffer::<i32>(&mut own, Fill::Zeros(n), what);
                Ok(OutputBufs {
                    raw: zeros(lens.0, "alloc raw")?,
                    page: zeros(lens.1, "alloc page")?,
                    published: match lens.2 {
                        Some(n) => Some(zeros(n.max(shape.num_blocks), "alloc published")?),
                        None => None,
                    },
                })
            }
            OutPlace::At {
                raw,
                page,
                published,
            } => {
                let at = |addr: u64, len: usize, what: &str| -> Result<Buf<i32>> {
                    if !measuring {
                        dev.zero(addr, 4 * len, what)?;
                    }
                    Ok(Buf::At { addr, len })
                };
                Ok(OutputBufs {
                    raw: at(raw, lens.0, "zero raw")?,
                    page: at(page, lens.1, "zero page")?,
                    published: match lens.2 {
                        Some(n) => Some(at(published, n, "zero published")?),
                        None => None,
                    },
                })
            }
        }
    }
}

impl Run {
    /// Upload the metadata of `batch`'s rows for `plan`'s tiles and take the transient
    /// buffers (in that order) from `space`, and the outputs at `out`, for a layer of
    /// shape `shape` whose inputs are at `ptrs` (`uploads`: host-input uploads the run
    /// keeps alive). Under [`Space::Measure`] nothing is written: the run only sizes
    /// its workspace ([`Space::used`]) and must not be launched.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn begin(
        dev: &Device,
        space: &mut Space,
        out: OutPlace,
        batch: &Batch,
        shape: Shape,
        ptrs: Ptrs,
        uploads: Uploads,
        plan: &Plan,
    ) -> Result<Run> {
        let t = batch.rows().len();
        let fp = batch_footprint(batch, shape.topk, dev.sm_count());
        let meta = RowMeta::new(batch, &shape, plan, &fp, dev.sm_count(), dev.hooks());
        // The transient buffers (metadata, logits tile, block keys, split scratch, path
        // counters), counted as Device::allocate allocates them on this thread, or as
        // the workspace's regions span them.
        let before = (allocated_on_this_thread(), space.used());
        let md = MetaBufs::upload(dev, space, &meta)?;
        let keys8 = meta.predecoded_keys * kernels::predecoded_key_bytes(shape.dim);
        let tr = TransientBufs::alloc(dev, space, plan, &meta.geom, shape.topk, keys8)?;
        let paths =
            dev.buffer::<u32>(space, Fill::Zeros(PATHS_BYTES / 4), "alloc path counters")?;
        let transient = match space {
            Space::Own => usize::try_from(allocated_on_this_thread() - before.0)
                .map_err(|_| super::backend_err("transient bytes past usize"))?,
            _ => space.used() - before.1,
        };
        let out = OutputBufs::alloc(dev, out, space.measuring(), t, &shape, meta.npub)?;
        let slots = plan.logits_slots.max(1);
        let side = match shape.select {
            Some(priority) if slots == 2 && !space.measuring() => {
                Some(SelectSide::new(dev, priority)?)
            }
            _ => None,
        };
        Ok(Run {
            side,
            slots,
            slot_elems: (plan.peak.logits_tile / slots / 4) as u64,
            shape,
            ptrs,
            meta: md,
            logits: tr.logits,
            bkeys: tr.bkeys,
            split: tr.split,
            keys8: tr.keys8.map(|buf| Predecoded {
                buf,
                keys: meta.predecoded_keys,
                map: None,
            }),
            geom: meta.geom,
            raw: out.raw,
            page: out.page,
            published: out.published,
            paths,
            uploads,
            transient,
            bitmap_words: meta.bitmap_words,
        })
    }

    /// The run's host-input uploads, the rest of its buffers freed.
    pub(super) fn into_uploads(self) -> Uploads {
        self.uploads
    }

    /// Launch tile `t`: logits, (source) block keys and kept blocks, top-k + assembly.
    /// With a selection stream, the selection is queued there after the logits, and the
    /// logits wait for the selection that last read the tile's slot; after the last
    /// tile the run's stream waits for every selection.
    pub(super) fn tile(&mut self, dev: &Device, t: usize) -> Result<()> {
        let Some(mut side) = self.side.take() else {
            self.logits_step(dev, t)?;
            return self.select_step(dev, t);
        };
        let r = self.tile_beside(dev, &mut side, t);
        self.side = Some(side);
        r
    }

    /// [`Run::tile`] with the selection on `side`'s stream.
    fn tile_beside(&mut self, dev: &Device, side: &mut SelectSide, t: usize) -> Result<()> {
        let slot = t % self.slots;
        if let Some(e) = side.slot_free[slot].as_ref() {
            dev.stream
                .wait(e)
                .map_err(drv("wait for the slot's selection"))?;
        }
        self.logits_step(dev, t)?;
        let done = dev
            .stream
            .record_event(None)
            .map_err(drv("record the tile's logits"))?;
        side.stream
            .wait(&done)
            .map_err(drv("wait for the tile's logits"))?;
        self.select_on(dev, &side.stream, t)?;
        side.slot_free[slot] = Some(
            side.stream
                .record_event(None)
                .map_err(drv("record the tile's selection"))?,
        );
        side.last = Some(slot);
        if t + 1 == self.geom.len() {
            side.join()?;
        }
        Ok(())
    }

    /// The f32 element at which tile `t`'s logits start in the logits buffer.
    pub(super) fn logits_slot_base(&self, t: usize) -> usize {
        (t % self.slots) * self.slot_elems as usize
    }

    /// [`Run::addrs`] on stream `s`, the logits address at tile `t`'s slot.
    fn tile_addrs(&self, s: &CudaStream, t: usize) -> RunAddrs {
        let mut a = self.addrs(s);
        if a.logits != 0 {
            a.logits += 4 * self.logits_slot_base(t) as u64;
        }
        a
    }

    /// The logits kernel of tile `t`.
    pub(super) fn logits_step(&mut self, dev: &Device, t: usize) -> Result<()> {
        let g = self.geom[t].clone();
        if g.rows.is_empty() {
            return Ok(());
        }
        let s = &dev.stream;
        let sh = self.shape;
        let p = self.ptrs;
        let a = self.tile_addrs(s, t);
        // 1. Logits.
        if g.chunks > 0 && a.logits != 0 {
            let (entry, threads) = g.logits;
            let f = dev.function(sh.logits_variant(), entry.name())?;
            let per_block = kernels::logits_launch_tiles_per_block(
                entry,
                g.chunks as usize,
                g.groups.len(),
                dev.sm_count(),
            );
            let gx = (g.chunks as usize).div_ceil(per_block) as u32;
            let lpaths = a.paths + 4 * kernels::TOPK_PATHS.len() as u64;
            // Pre-decoded keys: their scale windows, the map of their s8 operands and the
            // ring the entry copies them into; else the keys' own map, if the entry takes
            // one.
            let (predecoded, kmap, smem) = if kernels::logits_predecodes(sh.logits_variant(), entry)
            {
                let (kinfo, map) = self.predecoded(dev)?;
                (
                    Some(kinfo),
                    Some(map),
                    kernels::wgi8_ring_bytes(sh.dim) as u32,
                )
            } else {
                let map =
                    launch::key_tensor_map(entry, sh.logits_variant(), p.k, p.k_bytes, sh.paged)?;
                (None, map, 0)
            };
            let args = LogitsArgs {
                q: p.q,
                q_scale: p.q_scale,
                k: p.k,
                k_scale8: p.k_scale8,
                k_scale32: p.k_scale32,
                w: p.w,
                row_n: a.row_n,
                row_ks: a.row_ks,
                row_off: a.row_off,
                groups: a.groups,
                group0: g.groups.start as u32,
                logits: a.logits,
                paths: lpaths,
                paged: sh.paged.map(|pg| (p.page_table, pg.page_log2)),
                predecoded,
                kmap,
                smem,
            };
            launch::logits(s, &f, &args, g.groups.clone(), gx, threads as u32)?;
        }
        Ok(())
    }

    /// The pre-decoded keys' scale windows' address and the TMA map of their s8 operands
    /// ([`launch::predecoded_key_map`]), the keys written by [`kernels::WGI8_DECODE_KEYS`]
    /// on the run's stream and the map encoded the first time a launch asks.
    fn predecoded(&mut self, dev: &Device) -> Result<(u64, launch::TensorMap)> {
        let s = &dev.stream;
        let (v, dim) = (self.shape.logits_variant(), self.shape.dim);
        let k = (self.ptrs.k, self.ptrs.k_scale8);
        let p = self.keys8.as_mut().ok_or_else(|| {
            super::backend_err("a pre-decoding launch in a run without pre-decoded keys")
        })?;
        let base = p.buf.addr(s);
        let at = (base, base + (p.keys * dim) as u64);
        let map = match p.map {
            Some(m) => m,
            None => {
                let f = dev.function(v, kernels::WGI8_DECODE_KEYS)?;
                launch::decode_keys(s, &f, k, p.keys, at)?;
                *p.map.insert(launch::predecoded_key_map(at.0, p.keys, dim)?)
            }
        };
        Ok((at.1, map))
    }

    /// Candidate blocks, top-k and index assembly of tile `t` from its logits buffer, on
    /// the run's stream.
    pub(super) fn select_step(&mut self, dev: &Device, t: usize) -> Result<()> {
        self.select_on(dev, &dev.stream, t)
    }

    /// [`Run::select_step`] on stream `s`.
    fn select_on(&self, dev: &Device, s: &CudaStream, t: usize) -> Result<()> {
        let g = &self.geom[t];
        if g.rows.is_empty() {
            return Ok(());
        }
        let a = self.tile_addrs(s, t);
        // 2. Source: block keys, then kept blocks.
        if a.published != 0 && self.shape.tail.is_some() {
            self.candidate_blocks_step(dev, s, g, &a)?;
        }
        // 3. Top-k and index assembly.
        if g.segments > 1 && a.split != 0 {
            self.split_topk_step(dev, s, g, &a)
        } else {
            self.row_topk_step(dev, s, g, &a)
        }
    }

    /// Where the top-k kernels take each selected key's `page` column from: the run's
    /// `k_slots` over flat keys, its page table over paged keys.
    fn slot_table(&self) -> SlotTable {
        match self.shape.paged {
            Some(pg) => SlotTable {
                table: self.ptrs.page_table,
                page_log2: pg.page_log2,
            },
            None => SlotTable {
                table: self.ptrs.k_slots,
                page_log2: 0,
            },
        }
    }

    /// A source layer's block keys and kept blocks of tile geometry `g`'s rows.
    fn candidate_blocks_step(
        &self,
        dev: &Device,
        s: &CudaStream,
        g: &TileGeom,
        a: &RunAddrs,
    ) -> Result<()> {
        let sh = self.shape;
        let rows = g.rows.len() as u32;
        let row0 = g.rows.start as u32;
        let bs = sh.block_size as u32;
        let nbk = sh.num_blocks as u32;
        if g.max_blocks > 0 && a.bkeys != 0 && a.logits != 0 {
            let f = dev.function(Variant::Topk, "block_keys_f32")?;
            let gx = g.max_blocks.div_ceil(kernels::BLOCK_KEYS_THREADS).min(1024) as u32;
            let args = BlockKeysArgs {
                logits: a.logits,
                row_off: a.row_off,
                row_n: a.row_n,
                row_pub: a.row_pub,
                row_boff: a.row_boff,
                row0,
                block_size: bs,
                bkeys: a.bkeys,
            };
            launch::block_keys(s, &f, &args, rows, gx)?;
        }
        let f = dev.function(Variant::Topk, "kept_blocks_u32")?;
        let args = KeptBlocksArgs {
            bkeys: a.bkeys,
            row_n: a.row_n,
            row_pub: a.row_pub,
            row_boff: a.row_boff,
            row0,
            block_size: bs,
            num_blocks: nbk,
            published: a.published,
        };
        launch::kept_blocks(s, &f, &args, rows)
    }

    /// Dynamic shared memory of a top-k launch without the shared-memory row: a consumer
    /// row's bitmap of kept blocks (up to 160 KiB).
    fn topk_bitmap_smem(&self) -> u32 {
        if self.shape.consumer {
            self.bitmap_words * 4
        } else {
            0
        }
    }

    /// The top-k of tile geometry `g`'s rows split into segments (tiles of few rows):
    /// each segment's K best into the scratch, then the merge and index assembly.
    fn split_topk_step(
        &self,
        dev: &Device,
        s: &CudaStream,
        g: &TileGeom,
        a: &RunAddrs,
    ) -> Result<()> {
        let sh = self.shape;
        let p = self.ptrs;
        let rows = g.rows.len() as u32;
        let row0 = g.rows.start as u32;
        let k = sh.topk as u32;
        let smem = self.topk_bitmap_smem();
        let segs = g.segments as u32;
        let fs = dev.function(Variant::Topk, "topk_segments_f32")?;
        allow_dynamic_smem(&fs, smem)?;
        let args = TopkSegmentsArgs {
            logits: a.logits,
            row_off: a.row_off,
            row_n: a.row_n,
            row0,
            k,
            scratch: a.split,
            cblocks: p.cblocks,
            num_blocks: sh.num_blocks as u32,
            block_size: sh.block_size as u32,
            bitmap_words: self.bitmap_words,
            paths: a.paths,
        };
        launch::topk_segments(s, &fs, &args, segs, rows, smem)?;
        let fm = dev.function(Variant::Topk, "topk_merge_f32")?;
        let args = TopkMergeArgs {
            row_ks: a.row_ks,
            row0,
            k,
            segments: segs,
            scratch: a.split,
            raw: a.raw,
            page: a.page,
            page_cols: self.shape.page_cols as u32,
            slots: self.slot_table(),
            paths: a.paths,
        };
        launch::topk_merge(s, &fm, &args, rows)
    }

    /// The top-k and index assembly of tile geometry `g`'s rows, one block per row.
    fn row_topk_step(
        &self,
        dev: &Device,
        s: &CudaStream,
        g: &TileGeom,
        a: &RunAddrs,
    ) -> Result<()> {
        let sh = self.shape;
        let p = self.ptrs;
        let bw = self.bitmap_words;
        // The tile's rows of at most short_cap keys select with the row in shared memory
        // (topk_short_f32); the longer ones with passes over global memory and more
        // blocks per SM (topk_ragged_f32, rows of at least n_min keys), or, when the
        // tile's rows fit one wave of it, topk_ragged_wide_f32 (more candidate slots).
        let row_cap = g.short_cap;
        let n_min = if row_cap > 0 { row_cap + 1 } else { 0 };
        let short = (row_cap > 0).then(|| {
            let bytes = short_launch_smem(bw, row_cap as usize) as u32;
            (RowTopk::Short, row_cap, bytes)
        });
        let long = (g.max_n >= n_min as usize).then(|| {
            let (entry, bytes) = long_rows_launch(g.rows.len(), bw, dev.sm_count(), dev.hooks());
            (entry, n_min, bytes)
        });
        for (entry, bound, dyn_smem) in [short, long].into_iter().flatten() {
            let f = dev.function(Variant::Topk, entry.name())?;
            allow_dynamic_smem(&f, dyn_smem)?;
            let args = TopkRowsArgs {
                logits: a.logits,
                row_off: a.row_off,
                row_n: a.row_n,
                row_ks: a.row_ks,
                row0: g.rows.start as u32,
                k: sh.topk as u32,
                raw: a.raw,
                page: a.page,
                page_cols: sh.page_cols as u32,
                slots: self.slot_table(),
                cblocks: p.cblocks,
                num_blocks: sh.num_blocks as u32,
                block_size: sh.block_size as u32,
                bitmap_words: bw,
                row_bound: bound,
                paths: a.paths,
            };
            launch::topk_rows(s, &f, entry, &args, g.rows.len() as u32, dyn_smem)?;
        }
        Ok(())
    }
}
