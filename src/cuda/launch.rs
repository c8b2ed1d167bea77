//! One launcher per kernel family of a run, each with its arguments as a struct whose
//! fields are the kernel's parameters, in their order: the logits kernels
//! (`kernels/mqa_logits_*.cu`), the source layer's block keys and kept blocks, and the top-k
//! kernels (`kernels/topk.cu`). Device addresses are `u64` (0 = absent), counts `u32`,
//! as the kernels declare them.

use cudarc::driver::{CudaFunction, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg};

use super::device::{backend_err, drv};
use super::geometry::{Paging, RowTopk};
use super::kernels::{self, LogitsEntry, Variant};
use crate::error::Result;
use crate::problem::Format;

/// The most blocks a launch's grid may have along y: tiles of more row groups (or
/// rows) take several launches.
const MAX_GRID_Y: usize = 65535;

/// Raise `f`'s dynamic shared-memory limit to `bytes` (a consumer row's bitmap on top of
/// the top-k kernels' static 42 KiB exceeds the default 48 KiB); nothing for 0.
pub(super) fn allow_dynamic_smem(f: &CudaFunction, bytes: u32) -> Result<()> {
    if bytes > 0 {
        f.set_attribute(
            cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes as i32,
        )
        .map_err(drv("set shared memory size"))?;
    }
    Ok(())
}

/// The parameters of a logits kernel (`mqa_logits`, `mqa_logits_wgr`, `mqa_logits_w16`,
/// `mqa_logits_w8`: one signature, `mqa_logits_w8` at `D = 128` with the keys' TMA map
/// after it).
#[derive(Debug, Clone, Copy)]
pub(super) struct LogitsArgs {
    /// Queries: E4M3 `[T, H, D]` or packed E2M1 `[T, H, D/2]`.
    pub q: u64,
    /// UE8M0 query group scales `[T, H, G]` (E2M1 queries).
    pub q_scale: u64,
    /// Keys: E4M3 `[L, D]` or packed E2M1 `[L, D/2]`.
    pub k: u64,
    /// UE8M0 key group scales `[L, G]` (E2M1 keys).
    pub k_scale8: u64,
    /// f32 per-key scales `[L]` (E4M3 keys).
    pub k_scale32: u64,
    /// Weights `[T, H]`.
    pub w: u64,
    /// Visible keys per row.
    pub row_n: u64,
    /// Each row's request's first flat key, or over paged keys its first page-table entry.
    pub row_ks: u64,
    /// Each row's offset (floats) in the logits tile.
    pub row_off: u64,
    /// Row groups `(row0, rows, nmax, 0)`.
    pub groups: u64,
    /// The launch's first row group (grid y counts from it); [`logits`] sets it for
    /// each of its launches.
    pub group0: u32,
    /// The logits tile.
    pub logits: u64,
    /// The exact-class folding counters (`LG_PATH_*`).
    pub paths: u64,
    /// Paged keys (a `_paged` variant): the page table and `log2(P)`, the kernel's two
    /// last parameters; `k` is then the pool and `row_ks` each row's first page-table
    /// entry.
    pub paged: Option<(u64, u32)>,
    /// Pre-decoded flat keys (an entry [`kernels::logits_predecodes`] names): the address
    /// of their scale windows, the kernel's second last parameter, before the TMA map of
    /// their s8 operands in `kmap` ([`decode_keys`] writes both, [`predecoded_key_map`]).
    pub predecoded: Option<u64>,
    /// The keys' TMA map, the kernel's last parameter (`mqa_logits_w8` under `W8_TMA`:
    /// [`key_tensor_map`]; pre-decoded keys: [`predecoded_key_map`]).
    pub kmap: Option<TensorMap>,
    /// Dynamic shared memory per block (pre-decoded keys: [`kernels::wgi8_ring_bytes`]).
    pub smem: u32,
}

/// A TMA tensor map (a `CUtensorMap`: 128 opaque bytes), passed to a kernel by value as
/// a `__grid_constant__` parameter.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(64))]
pub(super) struct TensorMap([u64; 16]);

// SAFETY: plain bytes with the layout of the kernel's `TmaDesc` parameter.
unsafe impl DeviceRepr for TensorMap {}

/// The shape of a keys' TMA map ([`key_map_geometry`]): rank, dims (elements: bytes),
/// the byte strides of dims 1 and 2, and the box.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct MapGeometry {
    pub rank: u32,
    pub dims: [u64; 3],
    pub strides: [u64; 2],
    pub boxes: [u32; 3],
}

/// The TMA map's shape for E4M3 keys of `k_bytes` bytes that logits entry `entry` of
/// variant `v` takes, if it takes one (`mqa_logits_w8` at `D = 128`, unless the `W8_TMA=0`
/// define): boxes of 64 rows of 128 bytes, 128-byte swizzled (wgmma's A layout). Flat
/// keys: the `[L, 128]` codes. Paged keys: the pool as `[pages, P, 128]` with a page every
/// `P * 132` bytes (the codes come first in each page), boxes of `min(P, 64)` slots of one
/// page. Keys that hold no whole row or page are an error: the kernel declares the map,
/// and a launch without one would read past its arguments.
pub(super) fn key_map_geometry(
    entry: LogitsEntry,
    v: Variant,
    k_bytes: u64,
    paged: Option<Paging>,
) -> Result<Option<MapGeometry>> {
    let dim = match v {
        Variant::Logits {
            groups,
            k: Format::E4m3,
            ..
        } => groups as u64 * 32,
        _ => return Ok(None),
    };
    if entry != LogitsEntry::W8 || dim != 128 || !kernels::w8_tma() {
        return Ok(None);
    }
    let g = match paged {
        None => MapGeometry {
            rank: 2,
            dims: [dim, k_bytes / dim, 1],
            strides: [dim, 0],
            boxes: [dim as u32, 64, 1],
        },
        Some(pg) => {
            let p = 1u64 << pg.page_log2;
            let page_bytes = p * crate::paged::bytes_per_token(Format::E4m3, dim as usize) as u64;
            MapGeometry {
                rank: 3,
                dims: [dim, p, k_bytes / page_bytes],
                strides: [dim, page_bytes],
                boxes: [dim as u32, p.min(64) as u32, 1],
            }
        }
    };
    if g.dims[1] == 0 || g.dims[2] == 0 {
        return Err(backend_err(format!(
            "keys' TMA map: {k_bytes} bytes of keys hold no whole row or page (dims {:?})",
            g.dims
        )));
    }
    Ok(Some(g))
}

/// The TMA map of E4M3 keys at `k` (`k_bytes` bytes) that logits entry `entry` of
/// variant `v` takes, if it takes one: [`key_map_geometry`]'s shape, encoded by the
/// driver (rows past the buffer read as zeros).
pub(super) fn key_tensor_map(
    entry: LogitsEntry,
    v: Variant,
    k: u64,
    k_bytes: u64,
    paged: Option<Paging>,
) -> Result<Option<TensorMap>> {
    let Some(g) = key_map_geometry(entry, v, k_bytes, paged)? else {
        return Ok(None);
    };
    encode_map(k, &g, 128).map(Some)
}

/// The TMA map's shape for the pre-decoded keys' s8 operands (`nkeys` keys of `dim`
/// bytes, [`decode_keys`]), which `mqa_logits_wgi8_r8` copies into its ring: rows of
/// `dim` bytes, boxes of 64 rows (one key tile), swizzled at `dim` bytes (wgmma's K-major
/// A layout at that row width). No keys, or a row width the swizzle cannot take, is an
/// error.
pub(super) fn predecoded_map_geometry(nkeys: usize, dim: usize) -> Result<MapGeometry> {
    if nkeys == 0 || !matches!(dim, 64 | 128) {
        return Err(backend_err(format!(
            "pre-decoded keys' TMA map: {nkeys} keys of {dim} bytes"
        )));
    }
    Ok(MapGeometry {
        rank: 2,
        dims: [dim as u64, nkeys as u64, 1],
        strides: [dim as u64, 0],
        boxes: [dim as u32, kernels::LOGITS_KEYS as u32, 1],
    })
}

/// The TMA map of the pre-decoded keys' s8 operands at `k8`: [`predecoded_map_geometry`]'s
/// shape, encoded by the driver (rows past the keys read as zeros).
pub(super) fn predecoded_key_map(k8: u64, nkeys: usize, dim: usize) -> Result<TensorMap> {
    encode_map(k8, &predecoded_map_geometry(nkeys, dim)?, dim as u32)
}

/// A `u8` tensor map of shape `g` over the buffer at `addr`, its rows swizzled at
/// `swizzle` bytes (64 or 128), encoded by the driver (coordinates past the tensor read
/// as zeros).
fn encode_map(addr: u64, g: &MapGeometry, swizzle: u32) -> Result<TensorMap> {
    use cudarc::driver::sys::{
        cuTensorMapEncodeTiled, CUresult, CUtensorMap, CUtensorMapDataType,
        CUtensorMapFloatOOBfill, CUtensorMapInterleave, CUtensorMapL2promotion, CUtensorMapSwizzle,
    };
    let swizzle = match swizzle {
        64 => CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_64B,
        128 => CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
        _ => return Err(backend_err(format!("TMA map: no {swizzle}-byte swizzle"))),
    };
    let elem = [1u32; 3];
    let mut map = std::mem::MaybeUninit::<CUtensorMap>::zeroed();
    // SAFETY: every array holds at least `rank` (or `rank - 1` strides) entries; the
    // driver only writes the 128-byte map, which is suitably aligned.
    let r = unsafe {
        cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8,
            g.rank,
            addr as *mut std::ffi::c_void,
            g.dims.as_ptr(),
            g.strides.as_ptr(),
            g.boxes.as_ptr(),
            elem.as_ptr(),
            CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle,
            CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if r != CUresult::CUDA_SUCCESS {
        return Err(backend_err(format!(
            "cuTensorMapEncodeTiled (at {addr:#x}, dims {:?}): {r:?}",
            g.dims
        )));
    }
    // SAFETY: the driver filled the map.
    let map = unsafe { map.assume_init() };
    Ok(TensorMap(map.opaque))
}

/// Launch [`kernels::WGI8_DECODE_KEYS`] (`f`) over flat E2M1 keys `[0, nkeys)` (codes
/// at `k`, UE8M0 scales at `k_scale8`): their s8 operands to `k8` (`dim` bytes per key)
/// and their scale windows to `kinfo` (4 bytes per key).
pub(super) fn decode_keys(
    s: &CudaStream,
    f: &CudaFunction,
    (k, k_scale8): (u64, u64),
    nkeys: usize,
    (k8, kinfo): (u64, u64),
) -> Result<()> {
    if nkeys == 0 {
        return Ok(());
    }
    let threads = kernels::WGI8_DECODE_KEYS_THREADS;
    let blocks = u32::try_from((4 * nkeys).div_ceil(threads))
        .map_err(|_| backend_err(format!("decode keys: {nkeys} keys past one grid")))?;
    let n = u32::try_from(nkeys)
        .map_err(|_| backend_err(format!("decode keys: {nkeys} keys past u32")))?;
    let mut l = s.launch_builder(f);
    l.arg(&k).arg(&k_scale8).arg(&n).arg(&k8).arg(&kinfo);
    // SAFETY: the kernel reads keys [0, nkeys) of the flat key buffers (D / 2 code bytes
    // and G scale bytes each) and writes nkeys * D bytes at k8 and nkeys words at kinfo,
    // which the run allocated for them.
    unsafe {
        l.launch(LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (threads as u32, 1, 1),
            shared_mem_bytes: 0,
        })
    }
    .map_err(drv("launch wgi8_decode_keys"))?;
    Ok(())
}

/// Launch logits kernel `f` (`threads` per block) over row groups `groups`, `gx` blocks
/// of key tiles per group: one launch per [`MAX_GRID_Y`] groups.
pub(super) fn logits(
    s: &CudaStream,
    f: &CudaFunction,
    args: &LogitsArgs,
    groups: std::ops::Range<usize>,
    gx: u32,
    threads: u32,
) -> Result<()> {
    allow_dynamic_smem(f, args.smem)?;
    let mut start = groups.start;
    while start < groups.end {
        let count = (groups.end - start).min(MAX_GRID_Y);
        let a = LogitsArgs {
            group0: start as u32,
            ..*args
        };
        let mut l = s.launch_builder(f);
        l.arg(&a.q)
            .arg(&a.q_scale)
            .arg(&a.k)
            .arg(&a.k_scale8)
            .arg(&a.k_scale32)
            .arg(&a.w)
            .arg(&a.row_n)
            .arg(&a.row_ks)
            .arg(&a.row_off)
            .arg(&a.groups)
            .arg(&a.group0)
            .arg(&a.logits)
            .arg(&a.paths);
        let (page_table, page_log2) = a.paged.unwrap_or((0, 0));
        if a.paged.is_some() {
            l.arg(&page_table).arg(&page_log2);
        }
        let kinfo = a.predecoded.unwrap_or(0);
        if a.predecoded.is_some() {
            l.arg(&kinfo);
        }
        if let Some(m) = &a.kmap {
            l.arg(m);
        }
        // SAFETY: every pointer addresses a live device buffer of the shape the
        // kernel reads (validated problem); writes stay inside each row's
        // footprint in the logits tile, which the plan sized.
        unsafe {
            l.launch(LaunchConfig {
                grid_dim: (gx, count as u32, 1),
                block_dim: (threads, 1, 1),
                shared_mem_bytes: a.smem,
            })
        }
        .map_err(drv("launch mqa_logits"))?;
        start += count;
    }
    Ok(())
}

/// The parameters of `block_keys_f32`: the block keys of a tile's publishing rows.
#[derive(Debug, Clone, Copy)]
pub(super) struct BlockKeysArgs {
    /// The logits tile.
    pub logits: u64,
    /// Each row's offset (floats) in the logits tile.
    pub row_off: u64,
    /// Visible keys per row.
    pub row_n: u64,
    /// Each row's published index (-1: does not publish).
    pub row_pub: u64,
    /// Each publishing row's offset in the block keys.
    pub row_boff: u64,
    /// The launch's first row (grid y counts from it); [`block_keys`] sets it for each
    /// of its launches.
    pub row0: u32,
    /// `B`.
    pub block_size: u32,
    /// The block keys (written).
    pub bkeys: u64,
}

/// Launch `block_keys_f32` (`f`) over `rows` rows from `args.row0`, `gx` blocks per
/// row: one launch per [`MAX_GRID_Y`] rows.
pub(super) fn block_keys(
    s: &CudaStream,
    f: &CudaFunction,
    args: &BlockKeysArgs,
    rows: u32,
    gx: u32,
) -> Result<()> {
    let mut r = 0u32;
    while r < rows {
        let count = (rows - r).min(MAX_GRID_Y as u32);
        let a = BlockKeysArgs {
            row0: args.row0 + r,
            ..*args
        };
        let mut l = s.launch_builder(f);
        l.arg(&a.logits)
            .arg(&a.row_off)
            .arg(&a.row_n)
            .arg(&a.row_pub)
            .arg(&a.row_boff)
            .arg(&a.row0)
            .arg(&a.block_size)
            .arg(&a.bkeys);
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
    Ok(())
}

/// The parameters of `kept_blocks_u32`: the kept blocks of a tile's publishing rows
/// (SPEC 6).
#[derive(Debug, Clone, Copy)]
pub(super) struct KeptBlocksArgs {
    /// The block keys.
    pub bkeys: u64,
    /// Visible keys per row.
    pub row_n: u64,
    /// Each row's published index (-1: does not publish).
    pub row_pub: u64,
    /// Each publishing row's offset in the block keys.
    pub row_boff: u64,
    /// The tile's first row.
    pub row0: u32,
    /// `B`.
    pub block_size: u32,
    /// `NB`.
    pub num_blocks: u32,
    /// The published rows `[P, NB]` (written).
    pub published: u64,
}

/// Launch `kept_blocks_u32` (`f`): one block per row of the tile's `rows`.
pub(super) fn kept_blocks(
    s: &CudaStream,
    f: &CudaFunction,
    a: &KeptBlocksArgs,
    rows: u32,
) -> Result<()> {
    let mut l = s.launch_builder(f);
    l.arg(&a.bkeys)
        .arg(&a.row_n)
        .arg(&a.row_pub)
        .arg(&a.row_boff)
        .arg(&a.row0)
        .arg(&a.block_size)
        .arg(&a.num_blocks)
        .arg(&a.published);
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
    Ok(())
}

/// Where the top-k kernels take a selected key's `page` column from (the kernels'
/// `SlotMap`, indexed from each row's `row_ks`): over flat keys the pool slots
/// `k_slots [L]` (0: the identity), one slot a key; over paged keys the page table,
/// pages of `2^page_log2` slots.
#[derive(Debug, Clone, Copy)]
pub(super) struct SlotTable {
    /// `k_slots`, or the page table.
    pub table: u64,
    /// 0 over flat keys, `log2(P)` over paged keys.
    pub page_log2: u32,
}

/// The parameters of `topk_segments_f32`: each row's top-k split into segments, the K
/// best of each segment into the scratch.
#[derive(Debug, Clone, Copy)]
pub(super) struct TopkSegmentsArgs {
    /// The logits tile.
    pub logits: u64,
    /// Each row's offset (floats) in the logits tile.
    pub row_off: u64,
    /// Visible keys per row.
    pub row_n: u64,
    /// The tile's first row.
    pub row0: u32,
    /// `K`.
    pub k: u32,
    /// The split top-k's scratch `[rows, segments, K]` (written).
    pub scratch: u64,
    /// Consumer candidates `[T, NB]` (0: not a consumer).
    pub cblocks: u64,
    /// `NB`.
    pub num_blocks: u32,
    /// `B`.
    pub block_size: u32,
    /// Words of a consumer row's bitmap of kept blocks.
    pub bitmap_words: u32,
    /// The top-k path counters (`TK_PATH_*`).
    pub paths: u64,
}

/// Launch `topk_segments_f32` (`f`): grid (`segments`, `rows`), `smem` bytes of dynamic
/// shared memory.
pub(super) fn topk_segments(
    s: &CudaStream,
    f: &CudaFunction,
    a: &TopkSegmentsArgs,
    segments: u32,
    rows: u32,
    smem: u32,
) -> Result<()> {
    let mut l = s.launch_builder(f);
    l.arg(&a.logits)
        .arg(&a.row_off)
        .arg(&a.row_n)
        .arg(&a.row0)
        .arg(&a.k)
        .arg(&a.scratch)
        .arg(&a.cblocks)
        .arg(&a.num_blocks)
        .arg(&a.block_size)
        .arg(&a.bitmap_words)
        .arg(&a.paths);
    // SAFETY: block (s, r) reads segment s of row r's logits and writes its K ids
    // to scratch [r, s, :], sized rows * segments * K in begin.
    unsafe {
        l.launch(LaunchConfig {
            grid_dim: (segments, rows, 1),
            block_dim: (kernels::TOPK_THREADS as u32, 1, 1),
            shared_mem_bytes: smem,
        })
    }
    .map_err(drv("launch topk_segments_f32"))?;
    Ok(())
}

/// The parameters of `topk_merge_f32`: each row's K best of its segments' ids, and the
/// index assembly.
#[derive(Debug, Clone, Copy)]
pub(super) struct TopkMergeArgs {
    /// Each row's request's first flat key, or over paged keys its first page-table entry.
    pub row_ks: u64,
    /// The tile's first row.
    pub row0: u32,
    /// `K`.
    pub k: u32,
    /// Segments per row.
    pub segments: u32,
    /// The split top-k's scratch `[rows, segments, K]`.
    pub scratch: u64,
    /// `raw [T, K]` (written).
    pub raw: u64,
    /// `page [T, page_cols]` (written).
    pub page: u64,
    /// `page_cols`.
    pub page_cols: u32,
    /// Where `page` takes each selected key's slot from.
    pub slots: SlotTable,
    /// The top-k path counters (`TK_PATH_*`).
    pub paths: u64,
}

/// Launch `topk_merge_f32` (`f`): one block per row of the tile's `rows`.
pub(super) fn topk_merge(
    s: &CudaStream,
    f: &CudaFunction,
    a: &TopkMergeArgs,
    rows: u32,
) -> Result<()> {
    let mut l = s.launch_builder(f);
    l.arg(&a.row_ks)
        .arg(&a.row0)
        .arg(&a.k)
        .arg(&a.segments)
        .arg(&a.scratch)
        .arg(&a.raw)
        .arg(&a.page)
        .arg(&a.page_cols)
        .arg(&a.slots.table)
        .arg(&a.slots.page_log2)
        .arg(&a.paths);
    // SAFETY: row r reads its S*K scratch ids (each -1 or a visible key of the
    // row) and their ranking keys, and writes its rows of raw and page; each selected
    // key's slot is read from the slot table at an entry of the row's request (a key it
    // has: its k_slots entry, or the page-table entry of its page).
    unsafe {
        l.launch(LaunchConfig {
            grid_dim: (rows, 1, 1),
            block_dim: (kernels::TOPK_THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        })
    }
    .map_err(drv("launch topk_merge_f32"))?;
    Ok(())
}

/// The parameters of the one-block-per-row top-k kernels `topk_short_f32` and
/// `topk_ragged_f32` (one signature): selection and index assembly.
#[derive(Debug, Clone, Copy)]
pub(super) struct TopkRowsArgs {
    /// The logits tile.
    pub logits: u64,
    /// Each row's offset (floats) in the logits tile.
    pub row_off: u64,
    /// Visible keys per row.
    pub row_n: u64,
    /// Each row's request's first flat key, or over paged keys its first page-table entry.
    pub row_ks: u64,
    /// The tile's first row.
    pub row0: u32,
    /// `K`.
    pub k: u32,
    /// `raw [T, K]` (written).
    pub raw: u64,
    /// `page [T, page_cols]` (written).
    pub page: u64,
    /// `page_cols`.
    pub page_cols: u32,
    /// Where `page` takes each selected key's slot from.
    pub slots: SlotTable,
    /// Consumer candidates `[T, NB]` (0: not a consumer).
    pub cblocks: u64,
    /// `NB`.
    pub num_blocks: u32,
    /// `B`.
    pub block_size: u32,
    /// Words of a consumer row's bitmap of kept blocks.
    pub bitmap_words: u32,
    /// The rows the launch takes: `topk_short_f32`'s `row_cap` (rows of at most this
    /// many keys, which fit its shared memory), `topk_ragged_f32`'s `n_min` (rows of at
    /// least this many).
    pub row_bound: u32,
    /// The top-k path counters (`TK_PATH_*`).
    pub paths: u64,
}

/// Launch top-k entry `entry` (its function `f`): the entry's blocks for each row of the
/// tile's `rows`, `dyn_smem` bytes of dynamic shared memory.
pub(super) fn topk_rows(
    s: &CudaStream,
    f: &CudaFunction,
    entry: RowTopk,
    a: &TopkRowsArgs,
    rows: u32,
    dyn_smem: u32,
) -> Result<()> {
    let mut l = s.launch_builder(f);
    l.arg(&a.logits)
        .arg(&a.row_off)
        .arg(&a.row_n)
        .arg(&a.row_ks)
        .arg(&a.row0)
        .arg(&a.k)
        .arg(&a.raw)
        .arg(&a.page)
        .arg(&a.page_cols)
        .arg(&a.slots.table)
        .arg(&a.slots.page_log2)
        .arg(&a.cblocks)
        .arg(&a.num_blocks)
        .arg(&a.block_size)
        .arg(&a.bitmap_words)
        .arg(&a.row_bound)
        .arg(&a.paths);
    // SAFETY: each block reads its row's n logits (written by step 1, same
    // stream) and writes its row of raw [T, K] and page [T, page_cols], each
    // selected key's slot read from the slot table at an entry of the row's request
    // (a key it has: its k_slots entry, or the page-table entry of its page);
    // topk_short_f32 takes only rows of n <= row_cap, whose keys fit the
    // shared memory this launch sizes. topk_cluster_f32's grid is (cluster, rows), its
    // cluster size compiled in (__cluster_dims__), the blocks of a row one cluster.
    let per_row = entry.blocks_per_row();
    let grid_dim = if per_row > 1 {
        (per_row, rows, 1)
    } else {
        (rows, 1, 1)
    };
    unsafe {
        l.launch(LaunchConfig {
            grid_dim,
            block_dim: (kernels::TOPK_THREADS as u32, 1, 1),
            shared_mem_bytes: dyn_smem,
        })
    }
    .map_err(drv(entry.name()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::kernels::{Hooks, Precision, Variant};
    use super::*;
    use crate::problem::Format;

    /// The keys' TMA map: only `mqa_logits_w8` at `D = 128` takes one; flat keys as
    /// `[L, 128]`, pools as `[pages, P, 128]` with a page every `P * 132` bytes and boxes
    /// of `min(P, 64)` slots; every page size the kernels read gives strides of a multiple
    /// of 16 bytes (TMA's rule); keys of no whole row or page are an error.
    #[test]
    fn key_maps_span_the_keys_in_boxes_of_one_tile_or_one_page() {
        if !kernels::w8_tma() {
            return; // W8_TMA=0: no kernel takes a map
        }
        let fast = |g: usize, paged: bool| {
            Variant::logits(64, g, Format::E4m3, Format::E4m3, paged, Precision::Fast)
        };
        let flat = key_map_geometry(LogitsEntry::W8, fast(4, false), 1000 * 128, None)
            .unwrap()
            .unwrap();
        assert_eq!(
            flat,
            MapGeometry {
                rank: 2,
                dims: [128, 1000, 1],
                strides: [128, 0],
                boxes: [128, 64, 1],
            }
        );
        for p in [4usize, 8, 16, 32, 64, 128, 256] {
            let pg = Paging::new(Format::E4m3, 128, p, 10).unwrap();
            let page_bytes = (p * 132) as u64;
            let g = key_map_geometry(LogitsEntry::W8, fast(4, true), 7 * page_bytes, Some(pg))
                .unwrap()
                .unwrap();
            assert_eq!(g.rank, 3, "P = {p}");
            assert_eq!(g.dims, [128, p as u64, 7], "P = {p}");
            assert_eq!(g.strides, [128, page_bytes], "P = {p}");
            assert_eq!(g.boxes, [128, p.min(64) as u32, 1], "P = {p}");
            assert!(g.strides.iter().all(|s| s % 16 == 0), "P = {p}");
        }
        // Other kernels and dims take no map.
        for (name, v) in [
            (LogitsEntry::W8, fast(2, false)),
            (
                LogitsEntry::W16,
                Variant::logits(64, 4, Format::E4m3, Format::E4m3, false, Precision::Full),
            ),
            (LogitsEntry::Mma, fast(4, false)),
        ] {
            assert_eq!(
                key_map_geometry(name, v, 1 << 20, None).unwrap(),
                None,
                "{name}"
            );
        }
        let err = key_map_geometry(LogitsEntry::W8, fast(4, false), 100, None).unwrap_err();
        assert!(err.to_string().contains("no whole row or page"), "{err}");
    }

    /// The pre-decoded keys' map: rows of `D` bytes, boxes of one 64-key tile; no keys, or
    /// a row width other than 64 and 128 (the two swizzles), is an error.
    #[test]
    fn pre_decoded_keys_map_boxes_one_key_tile_of_their_rows() {
        let g = predecoded_map_geometry(1000, 128).unwrap();
        assert_eq!(
            (g.rank, g.dims, g.strides, g.boxes),
            (2, [128, 1000, 1], [128, 0], [128, 64, 1])
        );
        assert_eq!(predecoded_map_geometry(5, 64).unwrap().boxes, [64, 64, 1]);
        for (n, d) in [(0, 128), (10, 32), (10, 96)] {
            let err = predecoded_map_geometry(n, d).unwrap_err();
            assert!(
                err.to_string().contains("pre-decoded keys' TMA map"),
                "{err}"
            );
        }
    }

    #[test]
    fn wgmma_runs_the_h32_exact_class_and_h64_e4m3_and_mma_sync_the_rest() {
        #[cfg(feature = "tuning")]
        if std::env::var("DSA_CUDA_DEFINES").is_ok() {
            return; // an override changes the choice on purpose
        }
        let production = Hooks::default();
        let mma_sync = Hooks {
            mma_sync_only: true,
            ..Hooks::default()
        };
        for v in Variant::all() {
            let Variant::Logits {
                heads,
                groups,
                q,
                k,
                precision,
                ..
            } = v
            else {
                continue;
            };
            let (name, rows, threads) = kernels::logits_kernel(v, production);
            let wg = q == Format::E2m1 && k == Format::E2m1 && heads == 32 && groups >= 2;
            let w16 = q == Format::E4m3 && k == Format::E4m3 && heads == 64;
            let fast = precision == Precision::Fast;
            // Only E4M3 x E4M3 at H = 64 has a fast variant (Variant::logits).
            assert!(!fast || w16, "{}", v.name());
            // The exact class at H = 32, D >= 64 on s8 wgmma (mqa_logits_wgr's tile where
            // its guard rejects).
            assert_eq!(name == "mqa_logits_wgi8", wg, "{}", v.name());
            // E4M3 x E4M3 at H = 64 on f16 wgmma by default, on fp8 wgmma in the fast
            // mode.
            assert_eq!(name == "mqa_logits_w16", w16 && !fast, "{}", v.name());
            assert_eq!(name == "mqa_logits_w8", fast, "{}", v.name());
            assert_eq!(
                kernels::logits_on_fp8_accumulator(v, production),
                fast,
                "{}",
                v.name()
            );
            assert_eq!(
                kernels::logits_wgmma(v, production),
                wg || w16,
                "{}",
                v.name()
            );
            if wg {
                // One warpgroup per 4 rows: one MMA of 4 x 32 heads; launches of wide row
                // groups take the module's eight-row entry (two MMAs).
                assert_eq!((rows, threads), (4, 128), "{}", v.name());
                assert_eq!(
                    kernels::logits_kernel_for(v, production, true),
                    (LogitsEntry::Wgi8Wide, 8, 128),
                    "{}",
                    v.name()
                );
                assert_eq!(
                    kernels::module_entries(name),
                    ["mqa_logits_wgi8", "mqa_logits_wgi8_r8", "wgi8_decode_keys"],
                    "{}",
                    v.name()
                );
            } else if w16 {
                // One warpgroup per 2 rows: 2 x 64 heads = the 128 columns of its MMA.
                assert_eq!((rows, threads), (2, 128), "{}", v.name());
            } else {
                assert_eq!(rows, kernels::logits_rows(heads), "{}", v.name());
                assert_eq!(threads, rows * 32, "{}", v.name());
            }
            // Every other variant has one entry, whatever its launch's row groups.
            if !wg {
                let (entry, ..) = kernels::logits_kernel_for(v, production, true);
                assert_eq!((entry.name(), entry.kernel()), (name, name), "{}", v.name());
                assert_eq!(kernels::module_entries(name), [name], "{}", v.name());
            }
            // The host's choice is in the variant's source (tests/nvrtc_compile.rs checks
            // the compiled module's entries).
            assert!(
                v.source(production).contains(&format!("{name}(")),
                "{}",
                v.name()
            );
            // The no_int8_exact hook runs the exact class's wgmma shapes on
            // mqa_logits_wgr (2 rows per block, the same threads) and changes nothing else.
            let fp8 = Hooks {
                no_int8_exact: true,
                ..Hooks::default()
            };
            let (name8, rows8, threads8) = kernels::logits_kernel(v, fp8);
            if wg {
                assert_eq!(
                    (name8, rows8, threads8),
                    ("mqa_logits_wgr", kernels::LOGITS_WGR_ROWS, threads),
                    "{}",
                    v.name()
                );
                assert!(
                    v.source(fp8).contains(") mqa_logits_wgr(\n"),
                    "{}",
                    v.name()
                );
            } else {
                assert_eq!(
                    (name8, rows8, threads8),
                    (name, rows, threads),
                    "{}",
                    v.name()
                );
                assert!(v.source(fp8) == v.source(production), "{}", v.name());
            }
            // The mma.sync hook runs every variant on mqa_logits.
            let (name, rows, threads) = kernels::logits_kernel(v, mma_sync);
            assert_eq!(name, "mqa_logits", "{}", v.name());
            assert!(!kernels::logits_wgmma(v, mma_sync), "{}", v.name());
            assert_eq!(rows, kernels::logits_rows(heads), "{}", v.name());
            assert_eq!(threads, rows * 32, "{}", v.name());
            assert!(
                v.source(mma_sync).contains(") mqa_logits(\n"),
                "{}",
                v.name()
            );
        }
    }
}
