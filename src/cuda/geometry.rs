//! Tile geometry on the host: the layer's shape as the kernels see it and what they
//! support, the device's footprint per row (padded logits rows, metadata, split top-k
//! scratch, path counters), how many segments a row's top-k is split into, and the
//! short-row top-k's shared-memory capacity.

use super::kernels::{self, Hooks, LogitsEntry, Precision, Variant};
use std::ops::Range;

use crate::batch::{Batch, Request, Row};
use crate::error::{Error, Result};
use crate::indexer::RowFootprint;
use crate::plan::{Footprint, Plan};
use crate::problem::Format;

/// Logits row length on the device: `n` rounded up to 16 floats (64-byte rows).
pub const ROW_ALIGN: usize = 16;

/// Largest `K` the device top-k supports.
pub const MAX_TOPK: usize = 1 << 16;

/// Dynamic shared memory the consumer bitmap may take (bytes).
const MAX_BITMAP_BYTES: usize = 160 * 1024;

/// Dynamic shared memory a top-k block may take (bytes): the limit of sm_90 (227 KiB)
/// less the kernels' static 42 KiB.
const MAX_TOPK_DYNAMIC_SMEM: usize = 184 * 1024;

/// Per-row metadata bytes on the device: `n`, `ks` (u32), tile offset (u64), published
/// index (i32), block-key offset (u64), and up to one 16-byte row group per row.
const META_BYTES_PER_ROW: usize = 4 + 4 + 8 + 4 + 8 + 16;

/// Shape of a layer as the kernels see it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Shape {
    pub(super) heads: usize,
    pub(super) dim: usize,
    pub(super) q: Format,
    pub(super) k: Format,
    pub(super) topk: usize,
    pub(super) page_cols: usize,
    pub(super) block_size: usize,
    pub(super) num_blocks: usize,
    pub(super) tail: Option<Option<usize>>, // Some(tail) for a source
    pub(super) consumer: bool,
    /// Keys read from a page pool through a page table (SPEC 10).
    pub(super) paged: Option<Paging>,
    /// The tolerance class's arithmetic.
    pub(super) precision: Precision,
    /// Each tile's selection on a stream of its own beside the next tile's logits, in
    /// two logits slots (none: one stream, one slot).
    pub(super) select: Option<kernels::SelectStream>,
}

/// Paged keys as the kernels see them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Paging {
    /// `log2(P)`.
    pub(super) page_log2: u32,
    /// Page-table entries per request (`max_pages`): request `b`'s row starts at entry
    /// `b * table_cols`.
    pub(super) table_cols: usize,
}

impl Paging {
    /// The kernels' view of pages of `page_size` tokens of `format` keys of `dim`
    /// dimensions, `table_cols` page-table entries per request. The kernels load a key's
    /// codes with 16-byte loads, so a page must take a multiple of 16 bytes
    /// (`page_size * bytes_per_token`, e.g. `page_size` a multiple of 4 for E4M3 keys);
    /// an error naming `page_size` otherwise.
    pub(super) fn new(
        format: Format,
        dim: usize,
        page_size: usize,
        table_cols: usize,
    ) -> Result<Paging> {
        if !(page_size.is_power_of_two() && page_size <= crate::paged::MAX_PAGE_SIZE) {
            return Err(Error::range(
                "page_size",
                page_size,
                "a power of two in 1..=256",
            ));
        }
        let page_bytes = page_size * crate::paged::bytes_per_token(format, dim);
        if !page_bytes.is_multiple_of(16) {
            return Err(Error::range(
                "page_size",
                format!("{page_size} ({page_bytes}-byte pages of {format} keys, D = {dim})"),
                "pages of a multiple of 16 bytes on the CUDA backend (its kernels load keys 16 bytes at a time)",
            ));
        }
        Ok(Paging {
            page_log2: page_size.trailing_zeros(),
            table_cols,
        })
    }
}

impl Shape {
    /// Whether `row` (of a batch of `requests`) publishes its kept blocks: a source
    /// layer's rows within its tail (SPEC 6).
    pub(super) fn publishes(&self, row: &Row, requests: &[Request]) -> bool {
        self.tail
            .is_some_and(|tail| crate::batch::publishes(row, requests, tail))
    }

    /// The lengths of a run's outputs over `t` rows of which `npub` publish: `raw`
    /// (`t x K`), `page` (`t x page_cols`) and, for a source layer, `published`
    /// (`npub x NB`).
    pub(super) fn output_lens(&self, t: usize, npub: usize) -> (usize, usize, Option<usize>) {
        (
            t * self.topk,
            t * self.page_cols,
            self.tail.map(|_| npub * self.num_blocks),
        )
    }

    /// The logits module of this layer.
    pub(super) fn logits_variant(&self) -> Variant {
        Variant::logits(
            self.heads,
            self.dim / 32,
            self.q,
            self.k,
            self.paged.is_some(),
            self.precision,
        )
    }
}

/// Per-tile launch geometry, computed once on the host in `begin`.
#[derive(Debug, Clone)]
pub(super) struct TileGeom {
    pub(super) groups: std::ops::Range<usize>,
    pub(super) chunks: u32,
    pub(super) max_blocks: usize,
    pub(super) rows: std::ops::Range<usize>,
    pub(super) segments: usize,
    /// Shared-memory row capacity of the top-k launch for the tile's rows of at most
    /// [`kernels::TOPK_SHORT_CAP`] keys (the longest such row with more than K keys,
    /// rounded up to 8; 0: none).
    pub(super) short_cap: u32,
    /// The tile's longest row (keys).
    pub(super) max_n: usize,
    /// The tile's logits entry and threads per block ([`tile_logits_kernel`]).
    pub(super) logits: (LogitsEntry, usize),
}

/// Rows x segments of a tile whose top-k is split across blocks on a GPU of `sms` SMs
/// ([`split_segments`]): at most this many segment selections of `K` ids each (two per
/// row of a small tile, or two segments of each of fewer than four rows per SM).
pub(super) fn split_segments_cap(sms: usize) -> usize {
    (2 * split_rows(sms)).max(LONG_SPLIT_ROWS_PER_SM * 2 * sms)
}
/// Tiles of fewer than this many rows per SM whose rows reach [`LONG_SPLIT_KEYS`] keys
/// split each row into two segments.
const LONG_SPLIT_ROWS_PER_SM: usize = 4;
/// Keys of a segment of a long row ([`split_segments`]): rows of at least twice this
/// split in two (v41-1m at 2 GiB: tiles of 512 rows of a million keys, where the rows
/// the sampled threshold misjudges twice held the tile's one block per row).
pub(super) const LONG_SPLIT_KEYS: usize = 1 << 18;
/// The path counters on the device: the top-k's, then the logits kernels'.
pub(super) const PATHS_BYTES: usize = (kernels::TOPK_PATHS.len() + kernels::LOGITS_PATHS.len()) * 4;
/// Tiles with fewer rows than this (one per SM of a GPU of `sms` SMs, or
/// [`kernels::topk_split_rows_per_sm`] per SM) split each row's top-k across several
/// blocks.
pub(super) fn split_rows(sms: usize) -> usize {
    kernels::topk_split_rows_per_sm() * sms
}

/// Bytes of the split top-k's scratch per id a segment selects: the id, then its ranking
/// key (`topk_segments_f32` writes both, `topk_merge_f32` reads both).
pub(super) const SPLIT_BYTES_PER_ID: usize = 8;

/// The footprint of the device (of `sms` SMs) for a problem of `rows` rows, the longest
/// of `longest` keys, at `K = topk`: the per-row metadata and the split top-k's segment
/// scratch ([`split_scratch_bytes`]).
pub(super) fn footprint(rows: usize, longest: usize, topk: usize, sms: usize) -> RowFootprint {
    RowFootprint {
        align: ROW_ALIGN,
        workers: 1,
        worker_bytes: rows
            .saturating_mul(META_BYTES_PER_ROW)
            .saturating_add(split_scratch_bytes(longest, topk, sms))
            .saturating_add(PATHS_BYTES),
        logits_slots: 1,
    }
}

/// [`footprint`] of a run over `batch` at `K = topk`.
pub(super) fn batch_footprint(batch: &Batch, topk: usize, sms: usize) -> RowFootprint {
    footprint(batch.num_rows(), batch.longest_row(), topk, sms)
}

/// Whether rows of at most `max_n` keys stay whole at `K = topk` whatever the tile:
/// at most [`WHOLE_ROW_KEYS_PER_K`] `* K` keys ([`split_segments`]).
fn rows_stay_whole(max_n: usize, topk: usize) -> bool {
    max_n <= WHOLE_ROW_KEYS_PER_K.saturating_mul(topk.max(1))
}

/// Bytes of the split top-k's scratch a run whose longest row has `longest` keys may take
/// at `K = topk`: `split_segments_cap(sms) * K` ids, [`SPLIT_BYTES_PER_ID`] each, or none
/// when its rows all stay whole ([`rows_stay_whole`]: no tile of the run splits).
pub(super) fn split_scratch_bytes(longest: usize, topk: usize, sms: usize) -> usize {
    if rows_stay_whole(longest, topk) {
        0
    } else {
        split_segments_cap(sms)
            .saturating_mul(topk)
            .saturating_mul(SPLIT_BYTES_PER_ID)
    }
}

/// Flat keys a run of `shape` over `batch` under `hooks` pre-decodes for its logits
/// (`wgi8_decode_keys`, [`kernels::predecoded_key_bytes`] each): all of the batch's keys
/// when its rows taken as one tile take an entry that reads them
/// ([`kernels::logits_predecodes`]: prefill of the exact class at `H = 32`), else 0.
/// The run's tiles whose own entry reads them do so; in a run without them such a tile
/// takes the entry that decodes its keys in its blocks (the same logits).
pub(super) fn predecoded_keys(batch: &Batch, shape: &Shape, hooks: Hooks) -> usize {
    let v = shape.logits_variant();
    let (entry, _, _) = tile_logits_kernel(batch.rows(), 0..batch.num_rows(), v, hooks, true);
    if kernels::logits_predecodes(v, entry) {
        batch.num_keys()
    } else {
        0
    }
}

/// The footprint of a run of `shape` over `batch` on a GPU of `sms` SMs under `hooks`:
/// [`footprint`]'s, its per-run bytes with the pre-decoded keys ([`predecoded_keys`]), and
/// two logits slots when the selection runs on a stream of its own (`shape.select`).
pub(super) fn run_footprint(
    batch: &Batch,
    shape: &Shape,
    sms: usize,
    hooks: Hooks,
) -> RowFootprint {
    let mut fp = batch_footprint(batch, shape.topk, sms);
    fp.worker_bytes = fp.worker_bytes.saturating_add(
        predecoded_keys(batch, shape, hooks)
            .saturating_mul(kernels::predecoded_key_bytes(shape.dim)),
    );
    if shape.select.is_some() {
        fp.logits_slots = 2;
    }
    fp
}

/// Rows of at most this many times `K` keys never split: one block selects from the
/// whole row (on the sampled path from `8 K` keys). On the decode workloads (K = 2048)
/// that measured faster than the split into segments and a merge: 0.058 against 0.069
/// ms on one row of 131,072 keys (8 segments), 0.042 against 0.064 on 64 rows of 32,768
/// (2 segments; benches/RESULTS.md, The split top-k).
pub(super) const WHOLE_ROW_KEYS_PER_K: usize = 64;

/// Segments per row for a tile of `rows` rows whose longest row has `max_n` keys on a
/// GPU of `sms` SMs (1: no split): rows of at most [`WHOLE_ROW_KEYS_PER_K`] `* K` keys
/// (or below the `TK_SPLIT_MIN_KEYS` tuning define) stay whole; otherwise a tile of
/// fewer than [`split_rows`] rows splits its rows into up to 16 segments of at least
/// 8 K keys, two segment selections per such row and SM, and a tile of fewer than four
/// rows per SM splits rows of at least `2 * LONG_SPLIT_KEYS` keys in two.
pub(super) fn split_segments(rows: usize, max_n: usize, topk: usize, sms: usize) -> usize {
    if rows == 0 || rows_stay_whole(max_n, topk) || max_n < kernels::topk_split_min_keys() {
        return 1;
    }
    if rows < split_rows(sms) {
        return (2 * split_rows(sms) / rows)
            .min(16)
            .min(max_n / (8 * topk.max(1)))
            .max(1);
    }
    if rows < LONG_SPLIT_ROWS_PER_SM * sms && max_n >= 2 * LONG_SPLIT_KEYS && max_n >= 16 * topk {
        return 2;
    }
    1
}

/// The shared-memory row capacity (keys) of a tile's short-row top-k launch: the longest
/// of the tile's rows `ns` with `topk < n <= short` keys, rounded up to 8 (the kernel
/// reads the row 8 keys at a time), or 0 when there is none or when it would not fit the
/// dynamic shared memory beside a consumer's bitmap of `bitmap_words`. The tile's rows of
/// at most this many keys take `topk_short_f32`, the others `topk_ragged_f32`.
pub(super) fn short_row_cap(
    ns: impl Iterator<Item = usize>,
    topk: usize,
    short: usize,
    bitmap_words: u32,
) -> u32 {
    let longest = ns.filter(|&n| n > topk && n <= short).max().unwrap_or(0);
    let cap = longest.next_multiple_of(8);
    if longest > 0 && short_launch_smem(bitmap_words, cap) <= MAX_TOPK_DYNAMIC_SMEM {
        cap as u32
    } else {
        0
    }
}

/// The top-k entries whose blocks each take one row of a tile (`topk.cu`), or a cluster
/// of blocks one row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum RowTopk {
    /// `topk_short_f32`: rows of at most `row_cap` keys, each in shared memory.
    Short,
    /// `topk_ragged_f32`: passes over global memory, many blocks per SM.
    Ragged,
    /// `topk_ragged_wide_f32`: the same with more candidate slots, for tiles of few rows.
    Wide,
    /// `topk_cluster_f32`: a cluster of [`kernels::TOPK_CLUSTER`] blocks per row.
    Cluster,
}

impl RowTopk {
    /// The entry's name in the top-k module.
    pub(super) fn name(self) -> &'static str {
        match self {
            RowTopk::Short => "topk_short_f32",
            RowTopk::Ragged => "topk_ragged_f32",
            RowTopk::Wide => "topk_ragged_wide_f32",
            RowTopk::Cluster => "topk_cluster_f32",
        }
    }

    /// Blocks per row: the cluster's for [`RowTopk::Cluster`] (its grid is
    /// `(cluster, rows)`, the cluster size compiled into the kernel), else one.
    pub(super) fn blocks_per_row(self) -> u32 {
        match self {
            RowTopk::Cluster => kernels::TOPK_CLUSTER as u32,
            _ => 1,
        }
    }
}

/// The launch that takes a one-row-per-block top-k tile's long rows: its entry and
/// dynamic shared memory (bytes). [`RowTopk::Wide`] where [`kernels::topk_wide`] picks it
/// for `rows` rows and its candidate memory fits beside a consumer's bitmap of
/// `bitmap_words` (from a 16-byte boundary, as `topk_short_f32`'s row), or
/// [`RowTopk::Cluster`] (the same memory in each block of a row's cluster) where
/// [`kernels::topk_cluster`] picks that; else [`RowTopk::Ragged`], whose dynamic memory
/// is the bitmap alone.
pub(super) fn long_rows_launch(
    rows: usize,
    bitmap_words: u32,
    sms: usize,
    hooks: Hooks,
) -> (RowTopk, u32) {
    let wide = short_launch_smem(bitmap_words, 0) + kernels::TOPK_WIDE_SMEM;
    if kernels::topk_cluster(rows, sms, hooks) && wide <= MAX_TOPK_DYNAMIC_SMEM {
        (RowTopk::Cluster, wide as u32)
    } else if kernels::topk_wide(rows, sms, hooks) && wide <= MAX_TOPK_DYNAMIC_SMEM {
        (RowTopk::Wide, wide as u32)
    } else {
        (RowTopk::Ragged, bitmap_words * 4)
    }
}

/// Dynamic shared memory (bytes) of a `topk_short_f32` launch: the consumer bitmap's
/// `bitmap_words`, rounded up to 16 bytes, then `row_cap` keys (`topk.cu`'s layout).
pub(super) fn short_launch_smem(bitmap_words: u32, row_cap: usize) -> usize {
    (bitmap_words as usize).next_multiple_of(4) * 4 + row_cap * 4
}

/// Check what the kernels support, before any allocation.
pub(super) fn check_shape(s: &Shape, batch: &Batch) -> Result<()> {
    if s.topk > MAX_TOPK {
        return Err(Error::range(
            "topk",
            s.topk,
            "at most 65536 on the CUDA backend",
        ));
    }
    if batch.num_keys() >= (1usize << 31) {
        return Err(Error::range(
            "keys L",
            batch.num_keys(),
            "fewer than 2^31 keys on the CUDA backend",
        ));
    }
    if batch.num_rows() >= (1usize << 31) {
        return Err(Error::range(
            "rows T",
            batch.num_rows(),
            "fewer than 2^31 rows on the CUDA backend",
        ));
    }
    if let Some(pg) = s.paged {
        let entries = batch.requests().len().saturating_mul(pg.table_cols);
        if entries > u32::MAX as usize {
            return Err(Error::range(
                "page_table",
                format!("{entries} entries"),
                "fewer than 2^32 entries on the CUDA backend",
            ));
        }
    }
    if s.consumer && bitmap_words(batch, s.block_size) * 4 > MAX_BITMAP_BYTES {
        return Err(Error::range(
            "block_size",
            s.block_size,
            "consumer rows need ceil(n / B) / 8 <= 160 KiB of shared memory on the CUDA backend",
        ));
    }
    Ok(())
}

/// The 32-bit words of a consumer row's bitmap of kept blocks of `block_size` keys, one
/// bit a block, for the batch's longest row.
fn bitmap_words(batch: &Batch, block_size: usize) -> usize {
    batch.longest_row().div_ceil(block_size).div_ceil(32)
}

/// A run's per-row metadata and per-tile launch geometry, computed on the host once per
/// run (uploaded by the run's `begin`).
#[derive(Debug, Clone)]
pub(super) struct RowMeta {
    /// Visible keys per row.
    pub(super) row_n: Vec<u32>,
    /// Flat key offset per row; over paged keys, the row's request's first page-table
    /// entry.
    pub(super) row_ks: Vec<u32>,
    /// Each row's offset (floats) in its tile's logits buffer.
    pub(super) row_off: Vec<u64>,
    /// Each row's published index (-1: does not publish).
    pub(super) row_pub: Vec<i32>,
    /// Each publishing row's offset in its tile's block keys.
    pub(super) row_boff: Vec<u64>,
    /// Row groups, 4 words each: first row, rows, longest row, 0.
    pub(super) groups: Vec<u32>,
    /// Per tile.
    pub(super) geom: Vec<TileGeom>,
    /// Publishing rows.
    pub(super) npub: i32,
    /// Words of a consumer row's bitmap of kept blocks (0: not a consumer).
    pub(super) bitmap_words: u32,
    /// Flat keys the run pre-decodes for its logits ([`predecoded_keys`]; 0: none).
    pub(super) predecoded_keys: usize,
}

/// What every tile's geometry is computed from.
struct Layout<'a> {
    rows: &'a [Row],
    requests: &'a [Request],
    shape: &'a Shape,
    fp: &'a RowFootprint,
    /// The logits variant and the hooks its kernels run under (a tile's logits entry, and
    /// so its row groups' most rows, follows from them: [`tile_logits_kernel`]).
    variant: Variant,
    hooks: Hooks,
    /// The GPU's SMs.
    sms: usize,
    /// Longest row the shared-memory row may take ([`kernels::topk_short_cap`]).
    short_cap: usize,
    /// Whether the run pre-decodes its keys ([`predecoded_keys`]).
    predecoded: bool,
}

impl RowMeta {
    /// The metadata of `batch`'s rows for a layer of shape `shape` run in `plan`'s
    /// tiles on a GPU of `sms` SMs whose kernels run under `hooks`, each row taking
    /// `fp.row_bytes(n)` of its tile's logits buffer; the rows [`Shape::publishes`]
    /// names publish their kept blocks.
    pub(super) fn new(
        batch: &Batch,
        shape: &Shape,
        plan: &Plan,
        fp: &RowFootprint,
        sms: usize,
        hooks: Hooks,
    ) -> RowMeta {
        let rows = batch.rows();
        let t = rows.len();
        let mut m = RowMeta {
            row_n: Vec::with_capacity(t),
            row_ks: Vec::with_capacity(t),
            row_off: vec![0u64; t],
            row_pub: vec![-1i32; t],
            row_boff: vec![0u64; t],
            groups: Vec::new(),
            geom: Vec::with_capacity(plan.tiles.len()),
            npub: 0,
            bitmap_words: 0,
            predecoded_keys: predecoded_keys(batch, shape, hooks),
        };
        for r in rows {
            m.row_n.push(r.n as u32);
            m.row_ks.push(match shape.paged {
                Some(pg) => (r.request * pg.table_cols) as u32,
                None => r.ks as u32,
            });
        }
        // A consumer row's bitmap of kept blocks, then (from a 16-byte boundary) the
        // shared-memory row: the top-k launch's dynamic shared memory.
        m.bitmap_words = if shape.consumer {
            bitmap_words(batch, shape.block_size).max(1) as u32
        } else {
            0
        };
        let layout = Layout {
            rows,
            requests: batch.requests(),
            shape,
            fp,
            variant: shape.logits_variant(),
            hooks,
            sms,
            short_cap: kernels::topk_short_cap(hooks),
            predecoded: m.predecoded_keys > 0,
        };
        for tile in &plan.tiles {
            m.push_tile(&layout, tile.rows.clone());
        }
        m
    }

    /// Append tile `tile`'s row groups, its rows' offsets and published indices, and
    /// its geometry.
    fn push_tile(&mut self, l: &Layout<'_>, tile: Range<usize>) {
        let (rows, shape) = (l.rows, l.shape);
        let (mut off, mut boff) = (0u64, 0u64);
        let g0 = self.groups.len() / 4;
        let mut max_blocks = 0usize;
        let (lg_entry, lg_rows, lg_threads) =
            tile_logits_kernel(rows, tile.clone(), l.variant, l.hooks, l.predecoded);
        let max_n = push_row_groups(&mut self.groups, rows, tile.clone(), lg_rows);
        let short_cap = short_row_cap(
            rows[tile.clone()].iter().map(|r| r.n),
            shape.topk,
            l.short_cap,
            self.bitmap_words,
        );
        for i in tile.clone() {
            self.row_off[i] = off;
            off += (l.fp.row_bytes(rows[i].n) / 4) as u64;
            if shape.publishes(&rows[i], l.requests) {
                self.row_pub[i] = self.npub;
                self.npub += 1;
                self.row_boff[i] = boff;
                let nb = rows[i].n.div_ceil(shape.block_size);
                boff += nb as u64;
                max_blocks = max_blocks.max(nb);
            }
        }
        self.geom.push(TileGeom {
            groups: g0..self.groups.len() / 4,
            chunks: max_n.div_ceil(kernels::LOGITS_KEYS) as u32,
            max_blocks,
            rows: tile.clone(),
            segments: split_segments(tile.len(), max_n, shape.topk, l.sms),
            short_cap,
            max_n,
            logits: (lg_entry, lg_threads),
        });
    }
}

/// The logits entry of a tile of rows `rows[tile]` of variant `v` under `hooks` in a run
/// that has pre-decoded keys or not (`predecoded`, `predecoded_keys`): the entry, rows
/// per block, threads per block. [`kernels::logits_entry`] over the tile's row groups
/// (prefill's tiles take the wide entry; decode's rows of one to four per request do
/// not), except that in a run without pre-decoded keys a tile whose entry reads them
/// takes the entry that decodes its keys in its blocks (the same logits). Rows of `tile`
/// past `rows` are not part of it.
pub fn tile_logits_kernel(
    rows: &[Row],
    tile: Range<usize>,
    v: Variant,
    hooks: Hooks,
    predecoded: bool,
) -> (LogitsEntry, usize, usize) {
    let tile = within(tile, rows.len());
    let e = kernels::logits_entry(v, hooks, tile.len(), |r| {
        row_groups(rows, tile.clone(), r).len()
    });
    if !predecoded && kernels::logits_predecodes(v, e.0) {
        kernels::logits_kernel_for(v, hooks, false)
    } else {
        e
    }
}

/// The row groups of tile rows `rows[tile]` at most `lg_rows` rows each (at least one),
/// as the logits launches take them: runs of consecutive rows of one request. Rows of
/// `tile` past `rows` are not part of it.
pub fn row_groups(rows: &[Row], tile: Range<usize>, lg_rows: usize) -> Vec<Range<usize>> {
    let mut words = Vec::new();
    push_row_groups(&mut words, rows, within(tile, rows.len()), lg_rows.max(1));
    words
        .chunks_exact(4)
        .map(|g| g[0] as usize..(g[0] + g[1]) as usize)
        .collect()
}

/// `r` cut to `0..len`.
fn within(r: Range<usize>, len: usize) -> Range<usize> {
    r.start.min(len)..r.end.min(len).max(r.start.min(len))
}

/// Append the row groups of tile rows `tile` to `groups` (4 words each: first row, rows,
/// longest row, 0) and return the tile's longest row. A row group: up to one logits
/// block's `lg_rows` rows, consecutive, of one request.
fn push_row_groups(
    groups: &mut Vec<u32>,
    rows: &[Row],
    tile: Range<usize>,
    lg_rows: usize,
) -> usize {
    let mut max_n = 0usize;
    let mut i = tile.start;
    while i < tile.end {
        // A row group: up to one logits block's rows, consecutive, of one request.
        let mut e = i + 1;
        while e < tile.end
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
    max_n
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SMs of an H200 (and an H100 SXM).
    const H200_SMS: usize = 132;
    /// SMs of an H100 PCIe.
    const H100_PCIE_SMS: usize = 114;

    /// The plan parameters of [`exact_shape`]'s plain layer under `budget`.
    fn exact_plan_params(budget: usize) -> crate::plan::PlanParams {
        crate::plan::PlanParams {
            heads: 32,
            dim: 128,
            topk: 512,
            block_size: 8,
            num_blocks: 2048,
            role: crate::plan::PlanRole::Plain,
            budget,
        }
    }

    /// A layer shape of the exact class (`H = 32`, `D = 128`, K = 512), flat keys or pages.
    fn exact_shape(paged: Option<Paging>) -> Shape {
        Shape {
            heads: 32,
            dim: 128,
            q: Format::E2m1,
            k: Format::E2m1,
            topk: 512,
            page_cols: 512,
            block_size: 8,
            num_blocks: 2048,
            tail: None,
            consumer: false,
            paged,
            precision: Precision::Full,
            select: None,
        }
    }

    /// A prefill run of the exact class over flat keys pre-decodes every key of the batch
    /// (the footprint counts `D + 4` bytes each) and its tiles take the eight-row entry; a
    /// decode batch (one row per request) or paged keys pre-decode nothing, and a tile
    /// that would take the eight-row entry in a run without pre-decoded keys takes the
    /// four-row one.
    #[test]
    fn prefill_runs_pre_decode_their_keys_and_count_them() {
        #[cfg(feature = "tuning")]
        if std::env::var("DSA_CUDA_DEFINES").is_ok() {
            return; // WGI8_ROWS and WGI8_PREDECODE change the choice on purpose
        }
        let h = Hooks::default();
        let flat = exact_shape(None);
        let paged = exact_shape(Some(Paging::new(Format::E2m1, 128, 64, 8).unwrap()));
        let prefill = Batch::contiguous(&[300, 80], &[200, 0], 1).unwrap();
        assert_eq!(predecoded_keys(&prefill, &flat, h), 380);
        assert_eq!(predecoded_keys(&prefill, &paged, h), 0);
        let base = batch_footprint(&prefill, 512, H200_SMS).worker_bytes;
        assert_eq!(
            run_footprint(&prefill, &flat, H200_SMS, h).worker_bytes,
            base + 380 * (128 + 4)
        );
        assert_eq!(
            run_footprint(&prefill, &paged, H200_SMS, h).worker_bytes,
            base
        );
        let no_i8 = Hooks {
            no_int8_exact: true,
            ..Hooks::default()
        };
        assert_eq!(predecoded_keys(&prefill, &flat, no_i8), 0);
        // One row per request: the four-row entry, no pre-decoded keys.
        let decode = Batch::contiguous(&[50, 60, 70], &[49, 59, 69], 1).unwrap();
        assert_eq!(predecoded_keys(&decode, &flat, h), 0);
        // The tiles' entries follow: eight rows where the run pre-decodes.
        let entries = |b: &Batch, shape: &Shape| {
            let plan = crate::plan::plan(
                b,
                &exact_plan_params(1 << 30),
                &run_footprint(b, shape, H200_SMS, h),
            )
            .unwrap();
            let fp = batch_footprint(b, 512, H200_SMS);
            let m = RowMeta::new(b, shape, &plan, &fp, H200_SMS, h);
            (
                m.predecoded_keys,
                m.geom.iter().map(|g| g.logits.0).collect::<Vec<_>>(),
            )
        };
        assert_eq!(entries(&prefill, &flat), (380, vec![LogitsEntry::Wgi8Wide]));
        assert_eq!(entries(&prefill, &paged), (0, vec![LogitsEntry::Wgi8Wide]));
        // 9 rows of one request (wide alone) beside 40 one-row requests: the batch as a
        // whole is not wide, so the run does not pre-decode and its tile of all rows...
        let mut seq = vec![100usize];
        let mut q0 = vec![91usize];
        seq.extend(std::iter::repeat_n(30usize, 40));
        q0.extend(std::iter::repeat_n(29usize, 40));
        let mixed = Batch::contiguous(&seq, &q0, 1).unwrap();
        assert_eq!(entries(&mixed, &flat), (0, vec![LogitsEntry::Wgi8]));
        // ... and the same rows' wide part alone, in a run without pre-decoded keys,
        // takes the four-row entry.
        let l = Layout {
            rows: mixed.rows(),
            requests: mixed.requests(),
            shape: &flat,
            fp: &batch_footprint(&mixed, 512, H200_SMS),
            variant: flat.logits_variant(),
            hooks: h,
            sms: H200_SMS,
            short_cap: kernels::topk_short_cap(h),
            predecoded: false,
        };
        assert_eq!(
            tile_logits_kernel(mixed.rows(), 0..9, l.variant, h, true).0,
            LogitsEntry::Wgi8Wide
        );
        assert_eq!(
            tile_logits_kernel(mixed.rows(), 0..9, l.variant, h, false),
            kernels::logits_kernel_for(l.variant, h, false)
        );
        let mut m = RowMeta {
            row_n: mixed.rows().iter().map(|r| r.n as u32).collect(),
            row_ks: mixed.rows().iter().map(|r| r.ks as u32).collect(),
            row_off: vec![0; mixed.num_rows()],
            row_pub: vec![-1; mixed.num_rows()],
            row_boff: vec![0; mixed.num_rows()],
            groups: Vec::new(),
            geom: Vec::new(),
            npub: 0,
            bitmap_words: 0,
            predecoded_keys: 0,
        };
        m.push_tile(&l, 0..9);
        assert_eq!(m.geom[0].logits.0, LogitsEntry::Wgi8);
        m.push_tile(
            &Layout {
                predecoded: true,
                ..l
            },
            0..9,
        );
        assert_eq!(m.geom[1].logits.0, LogitsEntry::Wgi8Wide);
    }

    /// A tile of prefill rows (runs of more than four rows per request) takes
    /// `mqa_logits_wgi8`'s eight-row entry, a tile of decode rows (one to four per
    /// request) the four-row one, and the row groups follow the entry's rows; every other
    /// variant has its one entry whatever its rows.
    #[test]
    fn prefill_tiles_take_the_eight_row_entry_and_decode_tiles_the_four_row_one() {
        #[cfg(feature = "tuning")]
        if std::env::var("DSA_CUDA_DEFINES").is_ok() {
            return; // WGI8_ROWS forces one form on purpose
        }
        let exact = Variant::logits(32, 4, Format::E2m1, Format::E2m1, false, Precision::Full);
        let h = Hooks::default();
        let pick = |seq: &[usize], q0: &[usize]| {
            let b = Batch::contiguous(seq, q0, 1).unwrap();
            let rows = b.rows();
            let (name, r, _) = tile_logits_kernel(rows, 0..rows.len(), exact, h, true);
            (name, r, row_groups(rows, 0..rows.len(), r).len())
        };
        // Prefill: 100 rows of one request; 5 rows each (groups of 5 at eight rows: 5 > 4).
        assert_eq!(pick(&[300], &[200]), (LogitsEntry::Wgi8Wide, 8, 13));
        assert_eq!(pick(&[50, 60], &[45, 55]), (LogitsEntry::Wgi8Wide, 8, 2));
        // Decode: 1 and 4 rows per request (groups of 4 fill eight rows by half: not wide).
        assert_eq!(
            pick(&[50, 60, 70], &[49, 59, 69]),
            (LogitsEntry::Wgi8, 4, 3)
        );
        assert_eq!(pick(&[50, 60], &[46, 56]), (LogitsEntry::Wgi8, 4, 2));
        // A run of 9 rows: groups of 8 and 1 at eight rows (4.5 > 4 on average).
        assert_eq!(pick(&[50], &[41]), (LogitsEntry::Wgi8Wide, 8, 2));
        // Groups never span requests, and split at the entry's rows.
        let b = Batch::contiguous(&[50, 60], &[41, 57], 1).unwrap();
        assert_eq!(row_groups(b.rows(), 0..12, 4), [0..4, 4..8, 8..9, 9..12]);
        assert_eq!(row_groups(b.rows(), 2..12, 8), [2..9, 9..12]);
        // Rows past the batch are not part of a tile; an empty tile has no groups.
        let b = Batch::contiguous(&[50], &[41], 1).unwrap();
        assert_eq!(row_groups(b.rows(), 5..40, 4), vec![5..9]);
        assert_eq!(row_groups(b.rows(), 30..40, 4), []);
        assert_eq!(row_groups(b.rows(), Range { start: 7, end: 3 }, 4), []);
        assert_eq!(row_groups(b.rows(), 0..9, 0).len(), 9);
        assert_eq!(tile_logits_kernel(b.rows(), 0..100, exact, h, true).1, 8);
        assert_eq!(tile_logits_kernel(b.rows(), 40..100, exact, h, true).1, 4);
        // The hook that runs mqa_logits_wgr has one entry, as has every other variant.
        let wgr = Hooks {
            no_int8_exact: true,
            ..Hooks::default()
        };
        let b = Batch::contiguous(&[300], &[200], 1).unwrap();
        let all = 0..b.rows().len();
        assert_eq!(
            tile_logits_kernel(b.rows(), all.clone(), exact, wgr, true).0,
            LogitsEntry::Wgr
        );
        for v in Variant::all() {
            if matches!(v, Variant::Logits { .. }) && v != exact {
                let one = kernels::logits_kernel_for(v, h, false);
                if one.0 != LogitsEntry::Wgi8 {
                    assert_eq!(
                        tile_logits_kernel(b.rows(), all.clone(), v, h, true),
                        one,
                        "{}",
                        v.name()
                    );
                }
            }
        }
    }

    /// Long rows take the cluster launch up to one cluster of 8 blocks per row on every
    /// SM, then the wide launch up to 3 rows per SM, with its candidate memory after the
    /// consumer bitmap (rounded up to 16 bytes), while both fit the dynamic shared memory
    /// a top-k block may take; otherwise, or under `no_wide_topk`, the ragged launch with
    /// the bitmap alone. `no_cluster_topk` leaves the wide launch.
    #[test]
    fn long_rows_take_the_wide_launch_when_it_fits() {
        let h = Hooks::default();
        let wide = kernels::TOPK_WIDE_SMEM as u32;
        assert_eq!(kernels::TOPK_CLUSTER, 8);
        for (sms, clustered) in [(H200_SMS, 16), (H100_PCIE_SMS, 14)] {
            let most = kernels::TOPK_WIDE_BLOCKS_PER_SM * sms;
            for rows in [1, clustered] {
                assert_eq!(long_rows_launch(rows, 0, sms, h), (RowTopk::Cluster, wide));
            }
            assert_eq!(
                long_rows_launch(clustered, 5, sms, h),
                (RowTopk::Cluster, 32 + wide)
            );
            assert_eq!(
                long_rows_launch(clustered + 1, 0, sms, h),
                (RowTopk::Wide, wide)
            );
            let no_cluster = Hooks {
                no_cluster_topk: true,
                ..Hooks::default()
            };
            assert_eq!(
                long_rows_launch(1, 0, sms, no_cluster),
                (RowTopk::Wide, wide)
            );
            assert_eq!(RowTopk::Cluster.blocks_per_row(), 8);
            assert_eq!(RowTopk::Wide.blocks_per_row(), 1);
            assert_eq!(long_rows_launch(most, 0, sms, h), (RowTopk::Wide, wide));
            assert_eq!(long_rows_launch(most + 1, 0, sms, h), (RowTopk::Ragged, 0));
            assert_eq!(long_rows_launch(most + 1, 5, sms, h), (RowTopk::Ragged, 20));
        }
        assert_eq!(
            long_rows_launch(256, 5, H200_SMS, h),
            (RowTopk::Wide, 32 + wide)
        );
        let room = (MAX_TOPK_DYNAMIC_SMEM - kernels::TOPK_WIDE_SMEM) / 4;
        let fits = (room / 4 * 4) as u32;
        assert_eq!(
            long_rows_launch(256, fits, H200_SMS, h),
            (RowTopk::Wide, 4 * fits + wide)
        );
        assert_eq!(
            long_rows_launch(256, fits + 1, H200_SMS, h),
            (RowTopk::Ragged, 4 * (fits + 1))
        );
        let narrow = Hooks {
            no_wide_topk: true,
            ..Hooks::default()
        };
        assert_eq!(
            long_rows_launch(1, 0, H200_SMS, narrow),
            (RowTopk::Ragged, 0)
        );
    }

    /// The split top-k's scratch is planned as `split_segments_cap(sms) * K` ids: every
    /// tile's rows x segments must stay within it, and long rows of small tiles must
    /// split.
    #[test]
    fn split_segments_stay_within_the_planned_scratch() {
        for sms in [H200_SMS, H100_PCIE_SMS] {
            for rows in 0..400 {
                for max_n in [0usize, 1, 100, 4095, 4096, 65536, 1 << 20] {
                    for topk in [1usize, 7, 512, 2048, 65536] {
                        let s = split_segments(rows, max_n, topk, sms);
                        assert!(s >= 1);
                        if s > 1 {
                            assert!(rows * s <= split_segments_cap(sms), "rows {rows} x {s}");
                            assert!(max_n / s >= 8 * topk, "segments of >= 8 K keys");
                        }
                    }
                }
            }
            #[cfg(feature = "tuning")]
            if std::env::var("DSA_CUDA_DEFINES").is_ok() {
                continue; // TK_SPLIT_ROWS and TK_SPLIT_MIN_KEYS move the figures below
            }
            assert!(split_segments(64, 1 << 20, 512, sms) > 1);
            assert_eq!(split_segments(split_rows(sms), 1 << 17, 512, sms), 1);
            assert_eq!(split_segments(4 * sms, 1 << 20, 512, sms), 1);
        }
    }

    /// Rows of at most 64 K keys stay whole: the decode workloads at K = 2048 (one row of
    /// 131,072 keys; 64 rows of 32,768), not v41-1m's rows of a million keys at K = 512.
    #[test]
    fn rows_of_at_most_64_k_keys_stay_whole() {
        #[cfg(feature = "tuning")]
        if std::env::var("DSA_CUDA_DEFINES").is_ok() {
            return; // TK_SPLIT_ROWS and TK_SPLIT_MIN_KEYS change the figures on purpose
        }
        assert_eq!(split_segments(1, 131_072, 2048, H200_SMS), 1);
        assert_eq!(split_segments(64, 32_768, 2048, H200_SMS), 1);
        assert_eq!(split_segments(1, 131_073, 2048, H200_SMS), 8);
        assert_eq!(split_segments(64, 1 << 20, 512, H200_SMS), 4);
        assert_eq!(split_segments(3, 40_000, 512, H200_SMS), 9);
        assert_eq!(split_segments(3, 20_000, 700, H200_SMS), 1);
    }

    /// The split geometry follows the GPU's SM count: on an H200 tiles of fewer than 132
    /// rows split, two segment selections per row and SM; tiles of fewer than 528 rows
    /// split rows of a million keys in two (scratch for 1056 selections).
    #[test]
    fn split_geometry_scales_with_the_sm_count() {
        #[cfg(feature = "tuning")]
        if std::env::var("DSA_CUDA_DEFINES").is_ok() {
            return; // TK_SPLIT_ROWS changes the figures on purpose
        }
        assert_eq!(split_segments_cap(H200_SMS), 1056);
        assert_eq!(split_rows(H200_SMS), 132);
        assert_eq!(split_segments_cap(H100_PCIE_SMS), 912);
        assert_eq!(split_rows(H100_PCIE_SMS), 114);
        // v41-1m at 2 GiB (tiles of 512 rows, K = 512) in two; at 256 MiB (64 rows) as
        // before, in four; a V3.2 MTP decode batch (256 rows of 131,072 keys) not at all.
        assert_eq!(split_segments(512, 1 << 20, 512, H200_SMS), 2);
        assert_eq!(split_segments(64, 1 << 20, 512, H200_SMS), 4);
        assert_eq!(split_segments(256, 131_072, 2048, H200_SMS), 1);
        // 120 rows of 64K keys: split on an H200 (264 / 120 = 2 segments), not on an H100
        // PCIe; of a million keys, in two on both (fewer than four rows per SM).
        assert_eq!(split_segments(120, 1 << 16, 512, H200_SMS), 2);
        assert_eq!(split_segments(120, 1 << 16, 512, H100_PCIE_SMS), 1);
        assert_eq!(split_segments(120, 1 << 20, 512, H100_PCIE_SMS), 2);
    }

    #[test]
    fn short_row_cap_takes_the_longest_short_row_that_fits() {
        let cap = kernels::TOPK_SHORT_CAP;
        let k = 2048;
        // Rows of at most K keys need no row buffer; rows above the cap are long.
        assert_eq!(short_row_cap([1, 100, k].into_iter(), k, cap, 0), 0);
        assert_eq!(short_row_cap([cap + 1, 1 << 20].into_iter(), k, cap, 0), 0);
        assert_eq!(
            short_row_cap([k + 1].into_iter(), k, cap, 0),
            (k + 8) as u32
        );
        assert_eq!(
            short_row_cap([5, k + 1, 9000, cap + 1].into_iter(), k, cap, 0),
            9000
        );
        assert_eq!(
            short_row_cap([cap - 1, cap].into_iter(), k, cap, 0),
            cap as u32
        );
        // A rounded-up capacity: every row of the launch fits, read 8 keys at a time.
        let c = short_row_cap([9001].into_iter(), k, cap, 0);
        assert!(c as usize >= 9001 && c % 8 == 0 && c < 9001 + 8);
        // With a consumer's bitmap the row buffer must still fit: else no short launch.
        let room = ((MAX_TOPK_DYNAMIC_SMEM - 4 * 9008) / 4) as u32; // bitmap words
        assert_eq!(room % 4, 0);
        assert_eq!(short_row_cap([9001].into_iter(), k, cap, room), 9008);
        assert_eq!(short_row_cap([9001].into_iter(), k, cap, room + 1), 0);
        assert_eq!(short_launch_smem(room, 9008), MAX_TOPK_DYNAMIC_SMEM);
        assert_eq!(
            short_launch_smem(room + 1, 9008),
            MAX_TOPK_DYNAMIC_SMEM + 16
        );
        // Hooks::no_short_rows (short = 0): never.
        assert_eq!(short_row_cap([k + 1].into_iter(), k, 0, 0), 0);
    }

    /// The split scratch is counted where a row is longer than 64 K keys (some tile may
    /// split it), and only there: at 64 K keys or fewer every tile keeps its rows whole.
    #[test]
    fn footprint_counts_metadata_and_split_scratch() {
        #[cfg(feature = "tuning")]
        if std::env::var("DSA_CUDA_DEFINES").is_ok() {
            return; // TK_SPLIT_ROWS changes the figures on purpose
        }
        let fp = footprint(1000, 64 * 512 + 1, 512, H200_SMS);
        assert_eq!(fp.align, ROW_ALIGN);
        assert_eq!(
            fp.worker_bytes,
            1000 * META_BYTES_PER_ROW + 8 * H200_SMS * 512 * 8 + PATHS_BYTES
        );
        assert_eq!(fp.row_bytes(17), 32 * 4);
        let whole = footprint(1000, 64 * 512, 512, H200_SMS);
        assert_eq!(whole.worker_bytes, 1000 * META_BYTES_PER_ROW + PATHS_BYTES);
        // Where no row splits, no tile of any size or SM count does.
        for sms in [H200_SMS, H100_PCIE_SMS] {
            for rows in [1usize, 7, 131, 400] {
                for topk in [1usize, 512, 2048] {
                    let longest = 64 * topk;
                    assert_eq!(split_scratch_bytes(longest, topk, sms), 0);
                    assert_eq!(split_segments(rows, longest, topk, sms), 1);
                    assert!(split_scratch_bytes(longest + 1, topk, sms) > 0);
                }
            }
        }
        let b = Batch::contiguous(&[40_000, 9], &[39_000, 0], 1).unwrap();
        assert_eq!(
            batch_footprint(&b, 512, H200_SMS),
            footprint(b.num_rows(), 40_000, 512, H200_SMS)
        );
    }

    /// The kernels read pages of a multiple of 16 bytes; other page sizes are errors
    /// naming page_size (the backend gathers those pages on the host instead).
    #[test]
    fn paging_takes_pages_of_whole_16_byte_chunks() {
        for (f, d, ok) in [
            (Format::E4m3, 128, 4usize),
            (Format::E4m3, 32, 4),
            (Format::E2m1, 128, 4),
            (Format::E2m1, 64, 8),
            (Format::E2m1, 32, 16),
        ] {
            for p in (0..=8).map(|e| 1usize << e) {
                match Paging::new(f, d, p, 3) {
                    Ok(pg) => {
                        assert!(p >= ok, "{f} D = {d} P = {p}");
                        assert_eq!(
                            pg,
                            Paging {
                                page_log2: p.trailing_zeros(),
                                table_cols: 3
                            }
                        );
                    }
                    Err(Error::OutOfRange { field, value, .. }) => {
                        assert!(p < ok, "{f} D = {d} P = {p}");
                        assert_eq!(field, "page_size");
                        assert!(value.starts_with(&format!("{p} (")), "{value}");
                    }
                    Err(e) => panic!("{e:?}"),
                }
            }
        }
        for p in [0, 3, 512] {
            assert!(matches!(
                Paging::new(Format::E4m3, 128, p, 1),
                Err(Error::OutOfRange { field, .. }) if field == "page_size"
            ));
        }
    }

    /// With the selection on its own stream, v41-chunk's batch (its last 4,096 rows of
    /// 262,144 keys, 4.26 GB of logits) plans two slots: four tiles of at most a quarter
    /// of its logits plus one row, both slots within the 2 GiB budget; on one stream, two
    /// tiles of up to 2 GiB. The rows' logits offsets restart at each tile.
    #[test]
    fn selection_stream_plans_v41_chunk_in_two_slots_within_the_budget() {
        let h = Hooks::default();
        let batch = Batch::contiguous(&[262_144], &[262_144 - 4096], 1).unwrap();
        let one = exact_shape(None);
        let two = Shape {
            select: Some(kernels::SelectStream::Greatest),
            ..one
        };
        let plan = |shape: &Shape| {
            crate::plan::plan(
                &batch,
                &exact_plan_params(2 << 30),
                &run_footprint(&batch, shape, H200_SMS, h),
            )
            .unwrap()
        };
        let rows = |p: &crate::plan::Plan| p.tiles.iter().map(|t| t.rows.len()).collect::<Vec<_>>();
        let p1 = plan(&one);
        assert_eq!((p1.logits_slots, rows(&p1)), (1, vec![2072, 2024]));
        let p2 = plan(&two);
        assert_eq!(
            (p2.logits_slots, rows(&p2)),
            (2, vec![1031, 1026, 1022, 1017])
        );
        assert_eq!(p2.peak.logits_tile, 2 * 1_066_348_992);
        assert!(p2.peak.logits_tile <= 2 << 30);
        let fp = batch_footprint(&batch, 512, H200_SMS);
        let m = RowMeta::new(&batch, &two, &p2, &fp, H200_SMS, h);
        for t in &p2.tiles {
            assert_eq!(m.row_off[t.rows.start], 0, "tile {:?}", t.rows);
        }
    }
}
