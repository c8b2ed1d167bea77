//! Kernel sources (embedded), their variants, and NVRTC compilation for `sm_90a`.
//!
//! A module is the variant's `#define`s + `kernels/common.cuh` + its kernel files: for a
//! logits variant `kernels/logits_common.cuh` and the one family file of the kernel that
//! serves it ([`logits_kernel`]; the H = 64 wgmma kernels also `logits_e4m3_h64.cuh`),
//! for top-k `topk.cu`, for validation `validate.cu`. The two H = 32 exact-class kernels also
//! take `logits_wgr.cuh`, the H = 64 E4M3 ones `logits_e4m3_h64.cuh`. NVRTC compiles it at run time with
//! `--fmad=false --ftz=false` (SPEC 4 forbids contracted multiply-adds and flushing
//! subnormals) and no toolkit headers. Compilation needs only libnvrtc, not a GPU:
//! [`compile`] and [`compile_logits`] are what the NVRTC compile test calls.
//!
//! Two kinds of switches change a module or the host's kernel choice:
//!
//! - [`Hooks`], typed test hooks a [`crate::cuda::Device`] carries: each forces a
//!   fallback path that production also takes (on some inputs or some shapes), so that
//!   the tests can run that path on every input;
//! - with the `tuning` cargo feature only, `$DSA_CUDA_DEFINES` (`NAME=VALUE` pairs
//!   separated by spaces): occupancy and tile numbers for experiments (`LG_ROWS`,
//!   `LG_PER_BLOCK`, `LG_MIN_WAVES`, `*_MIN_BLOCKS`, `TK_SAMPLE_RATIO`, `TK_UNROLL`,
//!   `TK_SAMPLE_LOADS`, `TK_BITMAP`, `TK_SHORT_BITMAP`, `TK_COLLECT_MASK`, `TK_SEG_ALIGN`,
//!   `TK_SPLIT_MIN_KEYS`, `W8_RING`, `W8_TMA`, `W8_LPT`, `W16_LPT`, and `TK_STOP` for
//!   profiling a phase)
//!   and the host's `SELECT_STREAM` ([`select_stream`]),
//!   prepended to every kernel source as `#define`s. Without the feature the variable
//!   is never read, so a stray one in a serving process changes nothing.

use crate::error::{Error, Result};
use crate::problem::Format;

/// `kernels/common.cuh`.
pub const COMMON: &str = include_str!("../../kernels/common.cuh");
/// `kernels/logits_common.cuh`: what every logits kernel shares.
pub const LOGITS_COMMON: &str = include_str!("../../kernels/logits_common.cuh");
/// `kernels/mqa_logits_mma.cu`: `mqa_logits` (`mma.sync`).
pub const LOGITS_MMA: &str = include_str!("../../kernels/mqa_logits_mma.cu");
/// `kernels/logits_wgr.cuh`: the tile of `mqa_logits_wgr`, and the fallback tile of
/// `mqa_logits_wgi8`.
pub const LOGITS_WGR_TILE: &str = include_str!("../../kernels/logits_wgr.cuh");
/// `kernels/mqa_logits_wgr.cu`: `mqa_logits_wgr` (the exact class at `H = 32` on fp8
/// `wgmma`; [`Hooks::no_int8_exact`]).
pub const LOGITS_WGR: &str = include_str!("../../kernels/mqa_logits_wgr.cu");
/// `kernels/mqa_logits_wgi8.cu`: `mqa_logits_wgi8` (the exact class at `H = 32` on s8
/// `wgmma` where the scales and weights admit it, else `mqa_logits_wgr`'s tile).
pub const LOGITS_WGI8: &str = include_str!("../../kernels/mqa_logits_wgi8.cu");
/// `kernels/logits_e4m3_h64.cuh`: the tile of `mqa_logits_w16` and `mqa_logits_w8`.
pub const LOGITS_E4M3_H64: &str = include_str!("../../kernels/logits_e4m3_h64.cuh");
/// `kernels/mqa_logits_w16.cu`: `mqa_logits_w16` (E4M3 x E4M3 at `H = 64`, f16 `wgmma`).
pub const LOGITS_W16: &str = include_str!("../../kernels/mqa_logits_w16.cu");
/// `kernels/mqa_logits_w8.cu`: `mqa_logits_w8` (E4M3 x E4M3 at `H = 64`, fp8 `wgmma`).
pub const LOGITS_W8: &str = include_str!("../../kernels/mqa_logits_w8.cu");
/// `kernels/topk.cu`.
pub const TOPK: &str = include_str!("../../kernels/topk.cu");
/// `kernels/validate.cu`.
pub const VALIDATE: &str = include_str!("../../kernels/validate.cu");

/// Target architecture: Hopper with its arch-specific instructions.
pub const ARCH: &str = "sm_90a";

/// Rows per `mqa_logits` block (one warp each) for `H < 32` (`LG_ROWS` in
/// `mqa_logits_mma.cu`).
pub const LOGITS_ROWS: usize = 8;
/// Rows per `mqa_logits` block for `H >= 32` (register-bound: several 4-warp blocks per
/// SM).
pub const LOGITS_ROWS_LARGE_H: usize = 4;

/// Rows per logits block for `heads` in this process: [`LOGITS_ROWS`] or
/// [`LOGITS_ROWS_LARGE_H`], or an `LG_ROWS=` override in `$DSA_CUDA_DEFINES` (1..=16,
/// `tuning` feature; the kernel gets the same define).
pub fn logits_rows(heads: usize) -> usize {
    let default = if heads >= 32 {
        LOGITS_ROWS_LARGE_H
    } else {
        LOGITS_ROWS
    };
    define_in("LG_ROWS", 1..=16).unwrap_or(default)
}
/// Whether the logits of this variant run on Hopper `wgmma` rather than `mqa_logits`
/// (`mma.sync`): `mqa_logits_wgi8` for the exact class with `H = 32` and `D >= 64`
/// (`mqa_logits_wgr` under [`Hooks::no_int8_exact`]), `mqa_logits_w16` (f16 operands) for
/// E4M3 x E4M3 with `H = 64`.
/// [`Hooks::mma_sync_only`] turns both off (the `mma.sync` fallback, forced).
pub fn logits_wgmma(v: Variant, hooks: Hooks) -> bool {
    !hooks.mma_sync_only && wgmma_family(v).is_some()
}

/// The `wgmma` kernels that can serve variant `v`, default first, whatever the hooks
/// and `$DSA_CUDA_DEFINES` say: `mqa_logits_wgi8` and `mqa_logits_wgr` for the exact class
/// with `H = 32` and `D >= 64`, `mqa_logits_w16` and `mqa_logits_w8` for E4M3 x E4M3 with
/// `H = 64`.
fn wgmma_family(v: Variant) -> Option<&'static [&'static str]> {
    match v {
        Variant::Logits {
            heads: 32,
            groups,
            q: Format::E2m1,
            k: Format::E2m1,
            ..
        } if groups >= 2 => Some(&["mqa_logits_wgi8", "mqa_logits_wgr"]),
        Variant::Logits {
            heads: 64,
            q: Format::E4m3,
            k: Format::E4m3,
            ..
        } => Some(&["mqa_logits_w16", "mqa_logits_w8"]),
        _ => None,
    }
}

/// Every logits kernel that can serve variant `v` (empty for the top-k and validation
/// variants): `mqa_logits` (`mma.sync`) and the `wgmma` kernels of its shape.
/// [`logits_kernel`] picks one of them; [`compile_logits`] compiles any.
pub fn logits_kernels(v: Variant) -> Vec<&'static str> {
    match v {
        Variant::Logits { .. } => {
            let mut k = vec!["mqa_logits"];
            k.extend(wgmma_family(v).unwrap_or(&[]));
            k
        }
        _ => Vec::new(),
    }
}

/// Whether variant `v`'s logits kernel adds products on fp8 `wgmma`'s accumulator
/// (about 13 bits kept per addition): `mqa_logits_w8`.
pub fn logits_on_fp8_accumulator(v: Variant, hooks: Hooks) -> bool {
    logits_kernel(v, hooks).0 == "mqa_logits_w8"
}

/// Rows per `mqa_logits_w16` and `mqa_logits_w8` block (`H64_ROWS` in
/// `logits_e4m3_h64.cuh`: 2 rows x 64 heads = one 128-column MMA).
pub const LOGITS_W16_ROWS: usize = 2;

/// Rows per `mqa_logits_wgr` block (`WGR_ROWS` in `logits_wgr.cuh`: 2 rows x 32 heads =
/// one 64-column MMA).
pub const LOGITS_WGR_ROWS: usize = 2;

/// Rows per block of `mqa_logits_wgi8`'s four-row entry `mqa_logits_wgi8` (4 rows x 32
/// heads = one 128-column s8 MMA, whose key fragments are decoded once for the four).
pub const LOGITS_WGI8_ROWS: usize = 4;

/// Rows per block of `mqa_logits_wgi8`'s eight-row entry `mqa_logits_wgi8_r8` (two
/// 128-column MMAs from the same key fragments; over flat keys they are pre-decoded,
/// [`logits_predecodes`]).
pub const LOGITS_WGI8_WIDE_ROWS: usize = 8;

/// `mqa_logits_wgi8`'s form forced by a `WGI8_ROWS=4` or `WGI8_ROWS=8` define in
/// `$DSA_CUDA_DEFINES` (`tuning` feature; a host-side number): that form for every
/// launch. None: each launch takes the form its row groups favour ([`logits_kernel_for`]).
pub fn wgi8_rows_override() -> Option<usize> {
    define_in("WGI8_ROWS", 4..=8).filter(|&r| r == LOGITS_WGI8_ROWS || r == LOGITS_WGI8_WIDE_ROWS)
}

/// The pre-pass of `mqa_logits_wgi8_r8` over flat keys, in `mqa_logits_wgi8`'s module:
/// each key's s8 operands and scale window, written once per run, which the eight-row
/// entry then reads instead of decoding the fp4 keys in every block
/// (`kernels/mqa_logits_wgi8.cu`, "pre-decoded keys").
pub const WGI8_DECODE_KEYS: &str = "wgi8_decode_keys";

/// Threads per block of [`WGI8_DECODE_KEYS`] (four per key).
pub const WGI8_DECODE_KEYS_THREADS: usize = 256;

/// Bytes per flat key of the pre-decoded keys at `dim`: `dim` s8 operands and one `u32`
/// holding the key's smallest and largest scale byte.
pub fn predecoded_key_bytes(dim: usize) -> usize {
    dim + 4
}

/// Key tiles in the ring into which `mqa_logits_wgi8_r8` copies the pre-decoded keys by
/// TMA (the kernel's `WGI8_RING`: 2, or a `WGI8_RING=3` define under `tuning`).
pub fn wgi8_ring_tiles() -> usize {
    define_in("WGI8_RING", 2..=3).unwrap_or(2)
}

/// The dynamic shared memory of a launch that reads pre-decoded keys at `dim`: the ring's
/// [`wgi8_ring_tiles`] tiles of [`LOGITS_KEYS`] keys of `dim` bytes, and 1024 bytes to
/// align it (the TMA's swizzled boxes start on 1024-byte boundaries).
pub fn wgi8_ring_bytes(dim: usize) -> usize {
    wgi8_ring_tiles() * LOGITS_KEYS * dim + 1024
}

/// Whether launches of logits entry `entry` for variant `v` read pre-decoded keys
/// ([`WGI8_DECODE_KEYS`]): the eight-row `mqa_logits_wgi8_r8` over flat keys, unless a
/// `WGI8_PREDECODE=0` define (`tuning`; the kernel reads the same define) keeps the decode
/// in its blocks. The entry then takes the keys' scale windows' address and the TMA map
/// of their s8 operands (`launch::predecoded_key_map`) as its last parameters, and
/// [`wgi8_ring_bytes`] of dynamic shared memory.
pub fn logits_predecodes(v: Variant, entry: LogitsEntry) -> bool {
    let flat = matches!(v, Variant::Logits { paged: false, .. });
    flat && entry == LogitsEntry::Wgi8Wide && define_in("WGI8_PREDECODE", 0..=1) != Some(0)
}

/// Whether a launch of `rows` rows in `groups` row groups of at most `group_rows` rows
/// each fills them more than half on average: then a kernel's form of `group_rows` rows
/// per block pays (the eight-row `mqa_logits_wgi8_r8` on prefill); otherwise its blocks
/// would run as many MMAs and epilogues on padding as on rows (decode: one to four rows
/// per request).
pub fn groups_fill_wide(rows: usize, groups: usize, group_rows: usize) -> bool {
    2 * rows > groups * group_rows
}

/// `mqa_logits_wgi8`'s module: its two logits entries and the eight-row entry's key
/// pre-pass.
const WGI8_MODULE_ENTRIES: &[&str] = &[
    LogitsEntry::Wgi8.name(),
    LogitsEntry::Wgi8Wide.name(),
    WGI8_DECODE_KEYS,
];

/// The entries of the module that holds logits kernel `kernel` and that the host
/// launches by name: `mqa_logits_wgi8`'s module holds its eight-row form and that form's
/// key pre-pass ([`WGI8_DECODE_KEYS`]) beside it.
pub fn module_entries(kernel: &'static str) -> &'static [&'static str] {
    match kernel {
        "mqa_logits_wgi8" => WGI8_MODULE_ENTRIES,
        "mqa_logits" => &["mqa_logits"],
        "mqa_logits_wgr" => &["mqa_logits_wgr"],
        "mqa_logits_w16" => &["mqa_logits_w16"],
        "mqa_logits_w8" => &["mqa_logits_w8"],
        _ => &[],
    }
}

/// Threads per block of the `wgmma` logits kernels: one warpgroup (`WGR_THREADS`,
/// `H64_THREADS`).
pub const LOGITS_WG_THREADS: usize = 128;

/// Test hooks: each forces one fallback path, everywhere, that production takes only
/// on some inputs or shapes, so that the tests can hold that path to the reference on
/// every input. [`Hooks::default()`] is production: no hook set. A
/// [`crate::cuda::Device`] carries its hooks ([`crate::cuda::Device::with_hooks`]); its
/// modules are compiled under them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Hooks {
    /// The `mma.sync` kernel `mqa_logits` for every logits variant, where a `wgmma`
    /// kernel (`mqa_logits_wgr`, `mqa_logits_w16`) serves it by default. Production
    /// runs `mqa_logits` for every other variant (`H < 32`, `D = 32`, mixed formats):
    /// this hook holds it to the reference on the shapes the `wgmma` kernels take.
    pub mma_sync_only: bool,
    /// `SCALE_FOLD 0` in the exact-class logits kernels: every block takes the
    /// two-multiply epilogue with unfolded query operands. Production folds a block's
    /// scales into the MMA operands only when its query scales (and a key tile's) lie
    /// within 15 binades per group; a block or tile outside that window falls back to
    /// the unfolded epilogue, so that path runs in production on wide-ranged scales.
    pub no_scale_fold: bool,
    /// `TK_SHORT 0` in `topk.cu`, and the host launches every row through
    /// `topk_ragged_f32`: no row selects from its keys in shared memory. Production
    /// sends rows longer than [`TOPK_SHORT_CAP`] keys (or whose keys do not fit beside
    /// a consumer row's bitmap) to those passes over global memory.
    pub no_short_rows: bool,
    /// `TK_SAMPLED 0` in `topk.cu`: no row takes the sampled threshold; long rows take
    /// the two-pass histogram. Production takes that path for every row the sampled
    /// threshold does not serve (fewer than `TK_SAMPLE_MIN` or `TK_SAMPLE_RATIO * K`
    /// keys, among others) and falls back to it when a sample's candidates miss
    /// (fewer than `K` keys at or above its threshold, or more than `TK_CAND_CAP`).
    pub no_sampled_threshold: bool,
    /// `mqa_logits_wgr` for the exact class at `H = 32`, `D >= 64`, where production
    /// runs `mqa_logits_wgi8`: each key tile whose scales and weights pass its guard
    /// (every query vector and key spanning at most 3 binades, range bounds on the
    /// scales, and the weights' terms in f32's normal range; `kernels/mqa_logits_wgi8.cu`
    /// derives it) runs one exact `s8` `wgmma` chain over all groups and a head epilogue
    /// of three operations per head score, the others `mqa_logits_wgr`'s tile on each
    /// pair of rows ([`crate::cuda::FoldCounts`] counts the tiles on each path). Under
    /// this hook every tile runs `mqa_logits_wgr`, as on inputs the guard rejects.
    pub no_int8_exact: bool,
    /// `topk_ragged_f32` for every tile's long rows: no tile takes
    /// `topk_ragged_wide_f32`, which production launches for tiles of at most
    /// [`TOPK_WIDE_BLOCKS_PER_SM`] rows per SM ([`topk_wide`]).
    pub no_wide_topk: bool,
    /// `topk_ragged_wide_f32` (one block per row) where production launches
    /// `topk_cluster_f32` ([`topk_cluster`]: tiles of at most `sms /`
    /// [`TOPK_CLUSTER`] rows, whose sampled rows each take a cluster of blocks).
    pub no_cluster_topk: bool,
}

impl Hooks {
    /// The hooks' names, as [`Hooks::parse`] takes them (the field names).
    pub const NAMES: [&'static str; 7] = [
        "mma_sync_only",
        "no_scale_fold",
        "no_short_rows",
        "no_sampled_threshold",
        "no_int8_exact",
        "no_wide_topk",
        "no_cluster_topk",
    ];

    /// The hooks named in `list` (comma-separated field names, spaces allowed; empty:
    /// none); an unknown name is an error naming it.
    pub fn parse(list: &str) -> Result<Hooks> {
        let mut h = Hooks::default();
        for name in list.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            *h.field_mut(name).ok_or_else(|| {
                Error::range(
                    "hooks",
                    name,
                    "mma_sync_only, no_scale_fold, no_short_rows, no_sampled_threshold, \
                     no_int8_exact, no_wide_topk or no_cluster_topk",
                )
            })? = true;
        }
        Ok(h)
    }

    /// Each hook alone, with its name: the fallbacks a test runs one by one.
    pub fn each() -> Vec<(&'static str, Hooks)> {
        Hooks::NAMES
            .iter()
            .map(|&n| {
                let mut h = Hooks::default();
                *h.field_mut(n)
                    .unwrap_or_else(|| unreachable!("NAMES are fields")) = true;
                (n, h)
            })
            .collect()
    }

    fn field_mut(&mut self, name: &str) -> Option<&mut bool> {
        match name {
            "mma_sync_only" => Some(&mut self.mma_sync_only),
            "no_scale_fold" => Some(&mut self.no_scale_fold),
            "no_short_rows" => Some(&mut self.no_short_rows),
            "no_sampled_threshold" => Some(&mut self.no_sampled_threshold),
            "no_int8_exact" => Some(&mut self.no_int8_exact),
            "no_wide_topk" => Some(&mut self.no_wide_topk),
            "no_cluster_topk" => Some(&mut self.no_cluster_topk),
            _ => None,
        }
    }

    /// The `#define`s a logits module of formats `q`, `k` gets: `SCALE_FOLD` in the exact
    /// class, the only one that folds (`mma_sync_only` and `no_int8_exact` act in the host's
    /// choice of kernel, [`logits_kernel`]).
    fn logits_defines(self, q: Format, k: Format) -> &'static str {
        if self.no_scale_fold && q == Format::E2m1 && k == Format::E2m1 {
            "#define SCALE_FOLD 0\n"
        } else {
            ""
        }
    }

    /// The `#define`s the top-k module gets.
    fn topk_defines(self) -> String {
        let mut s = String::new();
        if self.no_short_rows {
            s += "#define TK_SHORT 0\n";
        }
        if self.no_sampled_threshold {
            s += "#define TK_SAMPLED 0\n";
        }
        s
    }
}

/// The defines that are test hooks now ([`Hooks`]); `$DSA_CUDA_DEFINES` drops them.
const HOOK_DEFINES: [&str; 4] = ["WGMMA", "SCALE_FOLD", "TK_SHORT", "TK_SAMPLED"];

/// `$DSA_CUDA_DEFINES` (`NAME=VALUE` pairs separated by spaces; tuning knobs for
/// experiments, prepended to every kernel source as `#define`s), read once per process,
/// only with the `tuning` feature (empty without). The forced fallbacks are [`Hooks`],
/// not defines: their names here ([`HOOK_DEFINES`]) are dropped.
fn defines() -> &'static [(String, String)] {
    #[cfg(feature = "tuning")]
    {
        static DEFINES: std::sync::OnceLock<Vec<(String, String)>> = std::sync::OnceLock::new();
        DEFINES.get_or_init(|| {
            std::env::var("DSA_CUDA_DEFINES")
                .unwrap_or_default()
                .split_whitespace()
                .filter_map(|kv| kv.split_once('='))
                .filter(|(k, _)| !HOOK_DEFINES.contains(k))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        })
    }
    #[cfg(not(feature = "tuning"))]
    {
        let _ = HOOK_DEFINES;
        &[]
    }
}

/// Whether `mqa_logits_w8` takes its keys by TMA into shared memory at `D = 128`: the
/// default; the `W8_TMA=0` define (`tuning` feature) keeps them in registers. The host
/// then passes the keys' tensor map (`launch::key_tensor_map`), and the k32 steps hold
/// dims in their natural order ([`crate::cuda::fp8_wgmma_step`]).
/// Like the preprocessor, the last `W8_TMA` define decides; only `0` turns it off.
pub fn w8_tma() -> bool {
    defines()
        .iter()
        .rev()
        .find(|(k, _)| k == "W8_TMA")
        .is_none_or(|(_, v)| v.trim() != "0")
}

/// The priority of the stream a run's selection takes when it has one of its own
/// ([`select_stream`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SelectStream {
    /// The default priority, as the run's stream's.
    Default,
    /// The device's greatest: a block of a tile's selection is scheduled before the
    /// next tile's logits blocks wherever both wait.
    Greatest,
}

/// Whether a run of more than one tile selects from each tile's logits on a stream of
/// its own while its stream computes the next tile's logits, each tile in one of two
/// logits slots of at most half the budget ([`crate::plan::Plan::logits_slots`]): the
/// `SELECT_STREAM` tuning define, `1` at the default priority, `2` at the greatest: the
/// default of [`crate::cuda::CudaBackend`] and [`crate::cuda::Engine`] (which their
/// `with_select_stream` overrides).
/// Absent or `0` (the default): one stream, each tile's selection after its logits.
pub fn select_stream() -> Option<SelectStream> {
    match define_in("SELECT_STREAM", 0..=2) {
        Some(1) => Some(SelectStream::Default),
        Some(2) => Some(SelectStream::Greatest),
        _ => None,
    }
}

/// The first value of define `name` in [`defines`] that is a number in `range`.
fn define_in(name: &str, range: std::ops::RangeInclusive<usize>) -> Option<usize> {
    defines()
        .iter()
        .filter(|(k, _)| k == name)
        .filter_map(|(_, v)| v.parse::<usize>().ok())
        .find(|v| range.contains(v))
}

/// A logits entry a launch runs: the `extern "C"` function ([`LogitsEntry::name`]) of
/// a logits kernel's module ([`LogitsEntry::kernel`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LogitsEntry {
    /// `mqa_logits`: `mma.sync`, every logits variant.
    Mma,
    /// `mqa_logits_wgr`: the exact class at `H = 32` on fp8 `wgmma`.
    Wgr,
    /// `mqa_logits_wgi8`: the exact class at `H = 32` on s8 `wgmma`, four rows per block.
    Wgi8,
    /// `mqa_logits_wgi8_r8`: the same, eight rows per block (wide row groups: prefill),
    /// in `mqa_logits_wgi8`'s module; over flat keys it reads pre-decoded keys
    /// ([`logits_predecodes`]).
    Wgi8Wide,
    /// `mqa_logits_w16`: E4M3 x E4M3 at `H = 64` on f16 `wgmma`.
    W16,
    /// `mqa_logits_w8`: E4M3 x E4M3 at `H = 64` on fp8 `wgmma`, the fast precision.
    W8,
}

impl LogitsEntry {
    /// The entry's function name in its module.
    pub const fn name(self) -> &'static str {
        match self {
            LogitsEntry::Mma => "mqa_logits",
            LogitsEntry::Wgr => "mqa_logits_wgr",
            LogitsEntry::Wgi8 => "mqa_logits_wgi8",
            LogitsEntry::Wgi8Wide => "mqa_logits_wgi8_r8",
            LogitsEntry::W16 => "mqa_logits_w16",
            LogitsEntry::W8 => "mqa_logits_w8",
        }
    }

    /// The logits kernel whose module holds the entry (one of [`logits_kernels`]).
    pub const fn kernel(self) -> &'static str {
        match self {
            LogitsEntry::Wgi8Wide => LogitsEntry::Wgi8.name(),
            e => e.name(),
        }
    }
}

impl std::fmt::Display for LogitsEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The logits kernel of variant `v` under `hooks`: the kernel its module holds (one of
/// [`logits_kernels`]), and the rows and threads per block of launches whose row groups
/// are not wide. The entry a launch runs is [`logits_kernel_for`]'s: the module of
/// `mqa_logits_wgi8` holds its eight-row entry `mqa_logits_wgi8_r8` too.
pub fn logits_kernel(v: Variant, hooks: Hooks) -> (&'static str, usize, usize) {
    let (entry, rows, threads) = logits_kernel_for(v, hooks, false);
    (entry.kernel(), rows, threads)
}

/// The logits entry of a launch of variant `v` under `hooks` whose row groups are wide
/// (`wide`: they hold more than four rows on average, [`groups_fill_wide`]) or not:
/// the entry, rows per block, threads per block. Only the exact class at `H = 32`,
/// `D >= 64` has two forms (`mqa_logits_wgi8_r8` for wide groups, `mqa_logits_wgi8` for
/// others, or the one [`wgi8_rows_override`] forces); every other variant has one entry.
pub fn logits_kernel_for(v: Variant, hooks: Hooks, wide: bool) -> (LogitsEntry, usize, usize) {
    let (heads, exact, fast) = match v {
        Variant::Logits {
            heads,
            q,
            k,
            precision,
            ..
        } => (
            heads,
            q == Format::E2m1 && k == Format::E2m1,
            precision == Precision::Fast,
        ),
        _ => (0, false, false),
    };
    if logits_wgmma(v, hooks) {
        if exact {
            if hooks.no_int8_exact {
                return (LogitsEntry::Wgr, LOGITS_WGR_ROWS, LOGITS_WG_THREADS);
            }
            let wide = wgi8_rows_override().map_or(wide, |r| r == LOGITS_WGI8_WIDE_ROWS);
            return if wide {
                (
                    LogitsEntry::Wgi8Wide,
                    LOGITS_WGI8_WIDE_ROWS,
                    LOGITS_WG_THREADS,
                )
            } else {
                (LogitsEntry::Wgi8, LOGITS_WGI8_ROWS, LOGITS_WG_THREADS)
            };
        }
        if fast {
            return (LogitsEntry::W8, LOGITS_W16_ROWS, LOGITS_WG_THREADS);
        }
        return (LogitsEntry::W16, LOGITS_W16_ROWS, LOGITS_WG_THREADS);
    }
    let rows = logits_rows(heads);
    (LogitsEntry::Mma, rows, rows * 32)
}

/// Keys per logits tile, every logits kernel (`LG_KEYS`, `WGR_KEYS`, `H64_KEYS`).
pub const LOGITS_KEYS: usize = 64;
/// Threads of a top-k block (`TK_THREADS` in `topk.cu`).
pub const TOPK_THREADS: usize = 512;
/// Ids per top-k chunk of the ordered pass (`TK_THREADS * TK_ITEMS`).
pub const TOPK_CHUNK: usize = 512 * 8;
/// Largest `K` of the top-k fast path (`TK_SEL_CAP`); above it, the general path.
pub const TOPK_SEL_CAP: usize = 4096;
/// Keys of the threshold bin the fast path resolves in shared memory (`TK_CAND_CAP`).
pub const TOPK_CAND_CAP: usize = 3072;
/// Candidate keys of `topk_ragged_wide_f32` (`TK_WIDE_CAP`).
pub const TOPK_WIDE_CAP: usize = 6144;
/// Dynamic shared memory of `topk_ragged_wide_f32` past a consumer's bitmap
/// (`TK_WIDE_SMEM`, the kernel's `sizeof(TopkWideSmem)`).
pub const TOPK_WIDE_SMEM: usize = 66_724;
/// Blocks per SM `topk_ragged_wide_f32` is built for (`TK_WIDE_MIN_BLOCKS`).
pub const TOPK_WIDE_BLOCKS_PER_SM: usize = 3;

/// Whether a one-row-per-block top-k launch of `rows` rows sends its long rows to
/// `topk_ragged_wide_f32` rather than `topk_ragged_f32`: when they fit one wave of it
/// (at most [`TOPK_WIDE_BLOCKS_PER_SM`] per SM), so that its fewer blocks per SM cost
/// nothing, unless [`Hooks::no_wide_topk`]. A sampled row there collects up to
/// [`TOPK_WIDE_CAP`] candidates, against [`TOPK_CAND_CAP`]: a second pass over the row
/// becomes rare, and such a launch lasts as long as its slowest row.
pub fn topk_wide(rows: usize, sm_count: usize, hooks: Hooks) -> bool {
    !hooks.no_wide_topk && rows <= TOPK_WIDE_BLOCKS_PER_SM * sm_count
}
/// Blocks per row of `topk_cluster_f32`, one cluster (`TK_CLUSTER`).
pub const TOPK_CLUSTER: usize = 8;
/// Whether a launch that [`topk_wide`] sends to `topk_ragged_wide_f32` takes
/// `topk_cluster_f32` instead: when each of its `rows` can have a cluster of
/// [`TOPK_CLUSTER`] blocks in one wave (at most `sm_count / TOPK_CLUSTER` rows), unless
/// [`Hooks::no_cluster_topk`]. A sampled row's collecting pass, the one pass over the
/// row, then runs on all of its cluster's SMs instead of one.
pub fn topk_cluster(rows: usize, sm_count: usize, hooks: Hooks) -> bool {
    topk_wide(rows, sm_count, hooks) && !hooks.no_cluster_topk && rows * TOPK_CLUSTER <= sm_count
}
/// The logits entry of a launch of `rows` rows of variant `v` under `hooks`, given how
/// many row groups they make at a block's most rows (`groups_at(rows_per_block)`): the
/// wide entry of [`logits_kernel_for`] where those groups at its rows fill them more than
/// half ([`groups_fill_wide`]), else the other; variants of one entry never call
/// `groups_at`. Prefill tiles (`cuda::tile_logits_kernel`) and decode steps (each request's
/// `next_n` rows a group of their own) both decide here.
pub fn logits_entry(
    v: Variant,
    hooks: Hooks,
    rows: usize,
    groups_at: impl FnOnce(usize) -> usize,
) -> (LogitsEntry, usize, usize) {
    let wide = logits_kernel_for(v, hooks, true);
    let narrow = logits_kernel_for(v, hooks, false);
    if wide != narrow && groups_fill_wide(rows, groups_at(wide.1), wide.1) {
        wide
    } else {
        narrow
    }
}

/// Most key tiles one logits block walks (the launch gives each block up to this many
/// so that a block's query staging is paid once per that many tiles): the logits ran
/// faster with each doubling from 16 to 128 tiles (benches/RESULTS.md). The launch takes
/// fewer tiles per block where more would leave too few blocks to fill the GPU several
/// waves over ([`logits_launch_tiles_per_block`]).
pub const LOGITS_TILES_PER_BLOCK: usize = 128;

/// Blocks of `mqa_logits_wgi8_r8` resident per SM: its launch bounds' minimum
/// (`WGI8_R8_MIN_BLOCKS`), which its registers allow and no more (168 per thread at
/// `D = 128`, with 32 bytes of spills over pre-decoded keys; 3 blocks ran its prefill 3 %
/// faster than 2 at 224 registers, benches/RESULTS.md).
pub const LOGITS_WGI8_WIDE_BLOCKS_PER_SM: usize = 3;

/// [`LOGITS_WGI8_WIDE_BLOCKS_PER_SM`], or the `WGI8_R8_MIN_BLOCKS=` define (1..=4,
/// `tuning`) that builds the kernel for that many.
pub fn wgi8_wide_blocks_per_sm() -> usize {
    define_in("WGI8_R8_MIN_BLOCKS", 1..=4).unwrap_or(LOGITS_WGI8_WIDE_BLOCKS_PER_SM)
}

/// Key tiles per block of a logits launch of `entry` over `chunks` key tiles and
/// `groups` row groups on `sms` SMs, up to [`logits_tiles_per_block`] so that a block's
/// query staging is paid once per that many:
/// - `mqa_logits_wgi8_r8`: whole waves. The launch takes `W` waves of
///   [`LOGITS_WGI8_WIDE_BLOCKS_PER_SM`] blocks per SM, at least [`LOGITS_MIN_WAVES`]
///   and as many as the largest blocks need, and spreads each group's tiles over its
///   share of them. Blocks of 124 tiles over v41-1m's tiles of 64 rows (8 groups) at
///   256 MiB made 1064 blocks, 4.03 waves, whose nearly empty last wave held them 14 %
///   behind the tiles of 512 rows at 2 GiB.
/// - every other entry: at least 8 blocks per SM.
pub fn logits_launch_tiles_per_block(
    entry: LogitsEntry,
    chunks: usize,
    groups: usize,
    sms: usize,
) -> usize {
    let (cap, groups, sms) = (logits_tiles_per_block(), groups.max(1), sms.max(1));
    if entry == LogitsEntry::Wgi8Wide {
        let slots = wgi8_wide_blocks_per_sm() * sms;
        let waves = (groups * chunks.div_ceil(cap))
            .div_ceil(slots)
            .max(logits_min_waves());
        let per_group = (waves * slots / groups).max(1);
        return chunks.div_ceil(per_group).clamp(1, cap);
    }
    (chunks * groups / (8 * sms)).clamp(1, cap)
}

/// Fewest waves of a launch of `mqa_logits_wgi8_r8` ([`logits_launch_tiles_per_block`]):
/// more waves make shorter blocks, each paying its query staging and ring fill. On
/// v41-1m at 256 MiB (8 groups of 16,384 key tiles a launch) 4 waves of blocks of 83
/// tiles ran 3.5 % faster than 8 of 42 tiles, and 3 or 6 waves between the two
/// (benches/RESULTS.md).
pub const LOGITS_MIN_WAVES: usize = 4;

/// [`LOGITS_MIN_WAVES`], or an `LG_MIN_WAVES=` override (1..=64) in `$DSA_CUDA_DEFINES`
/// (`tuning` feature; a host-side number).
pub fn logits_min_waves() -> usize {
    define_in("LG_MIN_WAVES", 1..=64).unwrap_or(LOGITS_MIN_WAVES)
}

/// [`LOGITS_TILES_PER_BLOCK`], or an `LG_PER_BLOCK=` override (1..=1024) in
/// `$DSA_CUDA_DEFINES` (`tuning` feature; a host-side number).
pub fn logits_tiles_per_block() -> usize {
    define_in("LG_PER_BLOCK", 1..=1024).unwrap_or(LOGITS_TILES_PER_BLOCK)
}

/// Rows per SM below which a tile's top-k splits each row across blocks: 1, or a
/// `TK_SPLIT_ROWS=` override (1..=8) in `$DSA_CUDA_DEFINES` (`tuning` feature; a
/// host-side number: the split's scratch grows with it).
pub fn topk_split_rows_per_sm() -> usize {
    define_in("TK_SPLIT_ROWS", 1..=8).unwrap_or(1)
}

/// Rows shorter than this never split their top-k across blocks: 0, or a
/// `TK_SPLIT_MIN_KEYS=` override (up to 2^24) in `$DSA_CUDA_DEFINES` (`tuning` feature; a
/// host-side number), which sends such rows of small tiles to one block each, on the
/// sampled path where they are long enough for it. At 262,144 on the decode workloads
/// (K = 2048) the selection took 0.058 ms against 0.069 split eight ways on one row of
/// 131,072 keys, and 0.042 against 0.064 split in two on 64 rows of 32,768
/// (benches/RESULTS.md).
pub fn topk_split_min_keys() -> usize {
    define_in("TK_SPLIT_MIN_KEYS", 0..=1 << 24).unwrap_or(0)
}

/// Rows of at most this many keys select from shared memory (the row's keys, 4 bytes
/// each, in the top-k block's dynamic shared memory): `topk.cu`'s shared-memory row.
pub const TOPK_SHORT_CAP: usize = 16384;

/// [`TOPK_SHORT_CAP`], or 0 under [`Hooks::no_short_rows`] (the fallback, forced: every
/// row through the passes over global memory of `topk_ragged_f32`).
pub fn topk_short_cap(hooks: Hooks) -> usize {
    if hooks.no_short_rows {
        0
    } else {
        TOPK_SHORT_CAP
    }
}
/// Path counters of the top-k kernels, in `topk.cu`'s `TK_PATH_*` order.
pub const TOPK_PATHS: [&str; 6] = ["ALL", "SHORT", "SAMPLED", "TWO", "GENERAL", "RESAMPLED"];
/// Exact-class path counters of the logits kernels (scale folding, and
/// `mqa_logits_wgi8`'s tiles), in `logits_common.cuh`'s `LG_PATH_*` order.
pub const LOGITS_PATHS: [&str; 6] = ["QFOLD", "QPLAIN", "ONE", "TWO", "I8", "I8_FALLBACK"];
/// Threads of a `block_keys_f32` block (`BK_THREADS` in `topk.cu`).
pub const BLOCK_KEYS_THREADS: usize = 256;
/// Threads of a `validate_inputs` block (`VAL_THREADS`, prepended to `validate.cu`).
pub const VALIDATE_THREADS: usize = 256;
/// Tensors one `validate_inputs` launch checks (`VAL_SEGS`): q or q_scale, k, k_scale,
/// weights, k_slots.
pub const VALIDATE_SEGMENTS: usize = 5;

/// The arithmetic of the tolerance class's logits (SPEC 4), chosen per backend or engine
/// ([`crate::cuda::CudaBackend::with_precision`], [`crate::cuda::Engine::with_precision`]).
/// The exact class (E2M1 x E2M1) is bitwise in both.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Precision {
    /// Within `2^-16 M` plus SPEC 4's absolute term for every input
    /// ([`crate::cuda::TOLERANCE_LOG2`]): E4M3 products on f16 tensor cores (or
    /// `mma.sync`) with f32 accumulation. The default.
    #[default]
    Full,
    /// Opt-in, never the default: E4M3 x E4M3 at `H = 64` on fp8 `wgmma`, the `D / 32`
    /// k32 steps of a head chained in the tensor core's accumulator, the arithmetic of
    /// DeepGEMM's kernel (`mqa_logits_w8`). Its accumulator keeps about 13 bits, so it is
    /// held to SPEC 4's fast-mode bound ([`crate::cuda::fast_logit_bound`]), not to
    /// `2^-8 M`. Every other variant runs as under [`Precision::Full`].
    Fast,
}

impl Precision {
    /// `"full"` or `"fast"`; anything else is an error naming `precision`.
    pub fn parse(name: &str) -> Result<Precision> {
        match name {
            "full" => Ok(Precision::Full),
            "fast" => Ok(Precision::Fast),
            other => Err(Error::range("precision", other, "full or fast")),
        }
    }

    /// Whether [`Precision::Fast`] has a kernel of its own for `heads` heads and formats
    /// `q` x `k` (E4M3 x E4M3 at `H = 64`); elsewhere it runs as [`Precision::Full`].
    pub fn has_kernel(heads: usize, q: Format, k: Format) -> bool {
        heads == 64 && q == Format::E4m3 && k == Format::E4m3
    }

    /// The name [`Precision::parse`] takes.
    pub fn name(self) -> &'static str {
        match self {
            Precision::Full => "full",
            Precision::Fast => "fast",
        }
    }
}

/// One compiled module.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Variant {
    /// The logits kernel for `H` heads, `G = D/32` groups and a format pair (one of
    /// [`logits_kernels`]).
    Logits {
        /// `H`.
        heads: usize,
        /// `D / 32`.
        groups: usize,
        /// Query format.
        q: Format,
        /// Key format.
        k: Format,
        /// Keys from a page pool through a page table (SPEC 10; `DSA_PAGED=1`): the
        /// kernels take the table and `log2(P)` as two more arguments.
        paged: bool,
        /// The tolerance class's arithmetic: [`Precision::Fast`] only where it has a
        /// kernel of its own (E4M3 x E4M3 at `H = 64`), [`Precision::Full`] elsewhere
        /// ([`Variant::logits`] normalises it), so that no module is compiled twice.
        precision: Precision,
    },
    /// `topk_ragged_f32`, `topk_short_f32`, `topk_segments_f32`, `topk_merge_f32`,
    /// `block_keys_f32`, `kept_blocks_u32`, `decode_codes`.
    Topk,
    /// `validate_inputs`: SPEC 8's value checks of device inputs.
    Validate,
}

fn fmt_code(f: Format) -> u32 {
    match f {
        Format::E4m3 => 0,
        Format::E2m1 => 1,
    }
}

impl Variant {
    /// The logits module of `heads` heads, `groups = D / 32`, formats `q` x `k`, flat or
    /// paged keys, under `precision`; [`Precision::Fast`] becomes [`Precision::Full`]
    /// where it changes nothing (every variant but E4M3 x E4M3 at `H = 64`).
    pub fn logits(
        heads: usize,
        groups: usize,
        q: Format,
        k: Format,
        paged: bool,
        precision: Precision,
    ) -> Variant {
        let fast_kernel = Precision::has_kernel(heads, q, k);
        Variant::Logits {
            heads,
            groups,
            q,
            k,
            paged,
            precision: if fast_kernel {
                precision
            } else {
                Precision::Full
            },
        }
    }

    /// Every variant the backend can load: 4 head counts x 3 dims x 4 format pairs x
    /// flat or paged keys (and the fast-precision E4M3 x E4M3 `H = 64` ones), top-k and
    /// validation.
    pub fn all() -> Vec<Variant> {
        let mut v = vec![Variant::Topk, Variant::Validate];
        for precision in [Precision::Full, Precision::Fast] {
            for paged in [false, true] {
                for heads in [8, 16, 32, 64] {
                    for groups in [1, 2, 4] {
                        for q in [Format::E4m3, Format::E2m1] {
                            for k in [Format::E4m3, Format::E2m1] {
                                let x = Variant::logits(heads, groups, q, k, paged, precision);
                                if !v.contains(&x) {
                                    v.push(x);
                                }
                            }
                        }
                    }
                }
            }
        }
        v
    }

    /// A short name (`logits_h32_g4_e2m1_e2m1`, `logits_h64_g4_e4m3_e4m3_paged`, `topk`,
    /// `validate`).
    pub fn name(&self) -> String {
        match *self {
            Variant::Logits {
                heads,
                groups,
                q,
                k,
                paged,
                precision,
            } => format!(
                "logits_h{heads}_g{groups}_{q}_{k}{}{}",
                if paged { "_paged" } else { "" },
                if precision == Precision::Fast {
                    "_fast"
                } else {
                    ""
                }
            ),
            Variant::Topk => "topk".into(),
            Variant::Validate => "validate".into(),
        }
    }

    /// The full NVRTC source of this variant's module under `hooks`: for a logits
    /// variant, that of the kernel [`logits_kernel`] picks ([`logits_source`]). The
    /// hooks' `#define`s come first, then, with the `tuning` feature, those of
    /// `$DSA_CUDA_DEFINES` (tuning numbers for experiments, e.g. `LG_MIN_BLOCKS=2`).
    pub fn source(&self, hooks: Hooks) -> String {
        match *self {
            Variant::Logits { .. } => logits_source(*self, logits_kernel(*self, hooks).0, hooks)
                .unwrap_or_else(|| unreachable!("logits_kernel picks one of logits_kernels")),
            Variant::Topk => {
                hooks.topk_defines() + &with_defines(&format!("{COMMON}\n{TOPK}"))
            }
            Variant::Validate => with_defines(&format!(
                "#define VAL_SEGS {VALIDATE_SEGMENTS}\n#define VAL_THREADS {VALIDATE_THREADS}\n{COMMON}\n{VALIDATE}"
            )),
        }
    }
}

/// `src` after the `#define`s of `$DSA_CUDA_DEFINES` (none without the `tuning` feature).
fn with_defines(src: &str) -> String {
    let extra: String = defines()
        .iter()
        .map(|(k, v)| format!("#define {k} {v}\n"))
        .collect();
    extra + src
}

/// The source of the module of logits variant `v` that holds `kernel` (one of
/// [`logits_kernels`]) under `hooks`: the hooks' `#define`s, `$DSA_CUDA_DEFINES`, the
/// variant's macros, `common.cuh`, `logits_common.cuh` and the kernel's family file. None
/// when `kernel` cannot serve `v`.
pub fn logits_source(v: Variant, kernel: &str, hooks: Hooks) -> Option<String> {
    let Variant::Logits {
        heads,
        groups,
        q,
        k,
        paged,
        ..
    } = v
    else {
        return None;
    };
    let family = match kernel {
        "mqa_logits" => LOGITS_MMA.to_string(),
        "mqa_logits_wgr" => format!("{LOGITS_WGR_TILE}\n{LOGITS_WGR}"),
        "mqa_logits_wgi8" => format!("{LOGITS_WGR_TILE}\n{LOGITS_WGI8}"),
        "mqa_logits_w16" => format!("{LOGITS_E4M3_H64}\n{LOGITS_W16}"),
        "mqa_logits_w8" => format!("{LOGITS_E4M3_H64}\n{LOGITS_W8}"),
        _ => return None,
    };
    if !logits_kernels(v).contains(&kernel) {
        return None;
    }
    Some(hooks.logits_defines(q, k).to_string() + &with_defines(&format!(
        "#define DSA_H {heads}\n#define DSA_G {groups}\n#define DSA_QF {}\n#define DSA_KF {}\n{}{COMMON}\n{LOGITS_COMMON}\n{family}",
        fmt_code(q),
        fmt_code(k),
        if paged { "#define DSA_PAGED 1\n" } else { "" }
    )))
}

/// Whether libnvrtc can be loaded (cudarc panics on first use otherwise).
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the library by its usual names; loads nothing else.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Compile one variant's module under `hooks` ([`Variant::source`]) to PTX for [`ARCH`].
/// Needs libnvrtc, not a GPU.
pub fn compile(v: Variant, hooks: Hooks) -> Result<cudarc::nvrtc::Ptx> {
    compile_source(&v.name(), v.source(hooks))
}

/// Compile the module of logits variant `v` that holds `kernel` ([`logits_source`]), as
/// [`compile`] does for the kernel the host picks; an error when `kernel` cannot serve
/// `v`.
pub fn compile_logits(v: Variant, kernel: &str, hooks: Hooks) -> Result<cudarc::nvrtc::Ptx> {
    let src = logits_source(v, kernel, hooks).ok_or_else(|| Error::Backend {
        backend: "cuda",
        problem: format!("{kernel} does not serve variant {}", v.name()),
    })?;
    compile_source(&format!("{}.{kernel}", v.name()), src)
}

/// NVRTC on one module's source; `name` names it in errors.
fn compile_source(name: &str, src: String) -> Result<cudarc::nvrtc::Ptx> {
    if !nvrtc_present() {
        return Err(Error::Backend {
            backend: "cuda",
            problem: "libnvrtc not found (install NVRTC 13.0 or put it on LD_LIBRARY_PATH)".into(),
        });
    }
    let opts = cudarc::nvrtc::CompileOptions {
        ftz: Some(false),
        prec_div: Some(true),
        prec_sqrt: Some(true),
        fmad: Some(false),
        use_fast_math: Some(false),
        arch: Some(ARCH),
        name: Some(format!("{name}.cu")),
        options: vec!["-std=c++17".into()],
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(src, opts).map_err(|e| {
        let detail = match &e {
            cudarc::nvrtc::CompileError::CompileError { log, .. } => {
                log.to_string_lossy().into_owned()
            }
            other => format!("{other:?}"),
        };
        Error::Backend {
            backend: "cuda",
            problem: format!("NVRTC failed on {name}: {detail}"),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The value of `#define name VALUE` in `src` (the rest of the line, without a
    /// trailing `//` comment), if `src` has one.
    fn define(src: &str, name: &str) -> Option<String> {
        src.lines().find_map(|l| {
            let rest = l
                .trim_start()
                .strip_prefix("#define ")?
                .strip_prefix(name)?;
            let rest = rest.strip_prefix(' ')?;
            Some(rest.split("//").next().unwrap_or("").trim().to_string())
        })
    }

    /// `#define name` in file `file` (`src`) is `want`.
    fn pinned(src: &str, file: &str, name: &str, want: impl std::fmt::Display) {
        assert_eq!(
            define(src, name),
            Some(want.to_string()),
            "{name} in kernels/{file}"
        );
    }

    /// `mqa_logits_wgi8`'s guard bounds are the host model's (`reference::int8_path`,
    /// whose tests check them against SPEC 4; docs/numerics.md 6.4 and 6.7).
    #[test]
    fn int8_guard_bounds_are_the_host_models() {
        use crate::reference::int8_path as m;
        let f = "mqa_logits_wgi8.cu";
        pinned(LOGITS_WGI8, f, "I8_MAX_SPAN", m::S8_MAX_SPAN);
        pinned(LOGITS_WGI8, f, "I8_MIN_EXP_SUM", m::MIN_EXP_SUM);
        pinned(LOGITS_WGI8, f, "I8_MAX_Q_EXP", m::MAX_Q_EXP);
        let (g4, g2) = (
            m::block_max_exp_sum(4).unwrap(),
            m::block_max_exp_sum(2).unwrap(),
        );
        pinned(
            LOGITS_WGI8,
            f,
            "I8_MAX_EXP_SUM",
            format!("(G == 4 ? {g4} : {g2})"),
        );
        pinned(LOGITS_WGI8, f, "I8_MIN_V_EXP", m::EPI_MIN_V_EXP);
        pinned(LOGITS_WGI8, f, "I8_MAX_V_EXP", m::EPI_MAX_V_EXP);
        pinned(LOGITS_WGI8, f, "I8_MIN_VK_EXP", m::EPI_MIN_VK_EXP);
        pinned(LOGITS_WGI8, f, "I8_MAX_VK_EXP", m::EPI_MAX_VK_EXP);
    }

    /// `Hooks::parse` takes the field names and names an unknown one; each hook's
    /// `#define` reaches the modules that read it and no other.
    #[test]
    fn hooks_parse_and_reach_their_modules() {
        assert_eq!(Hooks::parse(""), Ok(Hooks::default()));
        assert_eq!(
            Hooks::parse("mma_sync_only, no_scale_fold"),
            Ok(Hooks {
                mma_sync_only: true,
                no_scale_fold: true,
                ..Hooks::default()
            })
        );
        match Hooks::parse("no_scale_fold,wgmma") {
            Err(Error::OutOfRange { field, value, .. }) => {
                assert_eq!((field.as_str(), value.as_str()), ("hooks", "wgmma"))
            }
            other => panic!("{other:?}"),
        }
        let each = Hooks::each();
        assert_eq!(each.len(), Hooks::NAMES.len());
        for (name, h) in each {
            assert_eq!(Hooks::parse(name), Ok(h));
            assert_ne!(h, Hooks::default(), "{name}");
            for v in Variant::all() {
                let (src, base) = (v.source(h), v.source(Hooks::default()));
                let exact = matches!(
                    v,
                    Variant::Logits {
                        q: Format::E2m1,
                        k: Format::E2m1,
                        ..
                    }
                );
                let want = match (name, v) {
                    ("no_scale_fold", _) if exact => "#define SCALE_FOLD 0\n",
                    ("no_short_rows", Variant::Topk) => "#define TK_SHORT 0\n",
                    ("no_sampled_threshold", Variant::Topk) => "#define TK_SAMPLED 0\n",
                    _ => "",
                };
                if name == "mma_sync_only" && logits_wgmma(v, Hooks::default()) {
                    // Another kernel's module: the mma.sync family file.
                    assert!(
                        Some(src) == logits_source(v, "mqa_logits", Hooks::default()),
                        "{name} {}",
                        v.name()
                    );
                } else if name == "no_int8_exact" && logits_kernel(v, h).0 == "mqa_logits_wgr" {
                    // The exact class at H = 32, D >= 64: the fp8 kernel's module.
                    assert!(
                        Some(src) == logits_source(v, "mqa_logits_wgr", Hooks::default()),
                        "{name} {}",
                        v.name()
                    );
                } else {
                    assert!(src == format!("{want}{base}"), "{name} {}", v.name());
                }
            }
        }
    }

    /// The host's copies of `topk.cu`'s constants and of both path-counter orders.
    #[test]
    fn topk_constants_match_the_kernel() {
        for (name, v) in [
            ("TK_THREADS", TOPK_THREADS),
            ("TK_ITEMS", TOPK_CHUNK / TOPK_THREADS),
            ("TK_SEL_CAP", TOPK_SEL_CAP),
            ("TK_CAND_CAP", TOPK_CAND_CAP),
            ("TK_WIDE_CAP", TOPK_WIDE_CAP),
            ("TK_WIDE_SMEM", TOPK_WIDE_SMEM),
            ("TK_WIDE_MIN_BLOCKS", TOPK_WIDE_BLOCKS_PER_SM),
            ("TK_CLUSTER", TOPK_CLUSTER),
            ("TK_PATHS", TOPK_PATHS.len()),
            ("TK_SHORT_CAP", TOPK_SHORT_CAP),
            ("BK_THREADS", BLOCK_KEYS_THREADS),
        ] {
            pinned(TOPK, "topk.cu", name, v);
        }
        assert_eq!(TOPK_CHUNK, TOPK_THREADS * 8);
        for (i, name) in TOPK_PATHS.iter().enumerate() {
            pinned(TOPK, "topk.cu", &format!("TK_PATH_{name}"), i);
        }
        pinned(
            LOGITS_COMMON,
            "logits_common.cuh",
            "LG_PATHS",
            LOGITS_PATHS.len(),
        );
        for (i, name) in LOGITS_PATHS.iter().enumerate() {
            pinned(
                LOGITS_COMMON,
                "logits_common.cuh",
                &format!("LG_PATH_{name}"),
                i,
            );
        }
    }

    /// The host's copies of the logits kernels' tile and block constants, which the
    /// launches ([`logits_kernel`], [`LOGITS_KEYS`]) use.
    #[test]
    fn logits_constants_match_the_kernels() {
        let mma = "mqa_logits_mma.cu";
        pinned(LOGITS_MMA, mma, "LG_KEYS", LOGITS_KEYS);
        pinned(
            LOGITS_MMA,
            mma,
            "LG_ROWS",
            format!("(H >= 32 ? {LOGITS_ROWS_LARGE_H} : {LOGITS_ROWS})"),
        );
        pinned(LOGITS_MMA, mma, "LG_THREADS", "(LG_ROWS * 32)");
        let wgr = "logits_wgr.cuh";
        pinned(LOGITS_WGR_TILE, wgr, "WGR_KEYS", LOGITS_KEYS);
        pinned(LOGITS_WGR_TILE, wgr, "WGR_ROWS", LOGITS_WGR_ROWS);
        pinned(LOGITS_WGR_TILE, wgr, "WGR_THREADS", LOGITS_WG_THREADS);
        pinned(
            LOGITS_WGI8,
            "mqa_logits_wgi8.cu",
            "WGI8_R8_MIN_BLOCKS",
            LOGITS_WGI8_WIDE_BLOCKS_PER_SM,
        );
        // mqa_logits_wgi8's two entries, and their rows per block (the eight-row one with
        // the pre-decoded keys' parameters, logits_predecodes).
        for body in [
            format!(
                "mqa_logits_wgi8(\n    WGI8_PARAMS) {{\n  wgi8_block<{LOGITS_WGI8_ROWS}>(WGI8_ARGS, nullptr, nullptr);\n}}"
            ),
            format!(
                "mqa_logits_wgi8_r8(\n    WGI8_PARAMS WGI8_PRE_PARAMS) {{\n  wgi8_block<{LOGITS_WGI8_WIDE_ROWS}>(WGI8_ARGS WGI8_PRE_ARGS);\n}}"
            ),
        ] {
            assert!(LOGITS_WGI8.contains(&body), "{body}");
        }
        let h64 = "logits_e4m3_h64.cuh";
        pinned(LOGITS_E4M3_H64, h64, "H64_KEYS", LOGITS_KEYS);
        pinned(LOGITS_E4M3_H64, h64, "H64_ROWS", LOGITS_W16_ROWS);
        pinned(LOGITS_E4M3_H64, h64, "H64_THREADS", LOGITS_WG_THREADS);
        // Each kernel's launch bounds are its own block size.
        for (src, bounds) in [
            (
                LOGITS_MMA,
                "__launch_bounds__(LG_THREADS, LG_MIN_BLOCKS) mqa_logits(",
            ),
            (
                LOGITS_WGR,
                "__launch_bounds__(WGR_THREADS, WGR_MIN_BLOCKS) mqa_logits_wgr(",
            ),
            (
                LOGITS_WGI8,
                "__launch_bounds__(WGR_THREADS, WGI8_MIN_BLOCKS) mqa_logits_wgi8(",
            ),
            (
                LOGITS_WGI8,
                "__launch_bounds__(WGR_THREADS, WGI8_R8_MIN_BLOCKS) mqa_logits_wgi8_r8(",
            ),
            (
                LOGITS_W16,
                "__launch_bounds__(H64_THREADS, W16_MIN_BLOCKS) mqa_logits_w16(",
            ),
            (
                LOGITS_W8,
                "__launch_bounds__(H64_THREADS, W8_MIN_BLOCKS) mqa_logits_w8(",
            ),
        ] {
            assert!(src.contains(bounds), "{bounds}");
        }
    }

    /// A launch's entry: the exact class's eight-row entry where its groups at eight rows
    /// hold more than four rows on average (a decode step from `next_n = 5`), every other
    /// variant its one entry without asking for its groups.
    /// Only the eight-row entry of the exact class over flat keys reads pre-decoded keys.
    #[test]
    fn only_the_flat_eight_row_entry_reads_pre_decoded_keys() {
        #[cfg(feature = "tuning")]
        if std::env::var("DSA_CUDA_DEFINES").is_ok() {
            return; // WGI8_PREDECODE=0 turns it off on purpose
        }
        let v = |paged| Variant::logits(32, 4, Format::E2m1, Format::E2m1, paged, Precision::Full);
        assert!(logits_predecodes(v(false), LogitsEntry::Wgi8Wide));
        assert!(!logits_predecodes(v(true), LogitsEntry::Wgi8Wide));
        assert!(!logits_predecodes(v(false), LogitsEntry::Wgi8));
        assert!(!logits_predecodes(v(false), LogitsEntry::Wgr));
        assert_eq!(predecoded_key_bytes(128), 132);
        // Two ring tiles of 64 keys: 16 KiB at D = 128, and the alignment's 1 KiB.
        assert_eq!(wgi8_ring_bytes(128), 2 * 64 * 128 + 1024);
        assert!(LOGITS_WGI8.contains("#define WGI8_RING 2\n"));
        assert!(module_entries("mqa_logits_wgi8").contains(&WGI8_DECODE_KEYS));
        assert!(LOGITS_WGI8.contains(&format!("{WGI8_DECODE_KEYS}(")));
        assert!(LOGITS_WGI8.contains(&format!("__launch_bounds__({WGI8_DECODE_KEYS_THREADS})")));
    }

    #[test]
    fn logits_entry_takes_the_wide_form_for_groups_more_than_half_full() {
        #[cfg(feature = "tuning")]
        if std::env::var("DSA_CUDA_DEFINES").is_ok() {
            return; // WGI8_ROWS forces one entry on purpose
        }
        let h = Hooks::default();
        let exact = Variant::logits(32, 4, Format::E2m1, Format::E2m1, true, Precision::Full);
        let decode = |next_n: usize| logits_entry(exact, h, next_n, |r| next_n.div_ceil(r)).0;
        for next_n in 1..=4 {
            assert_eq!(decode(next_n), LogitsEntry::Wgi8, "next_n {next_n}");
        }
        for next_n in 5..=8 {
            assert_eq!(decode(next_n), LogitsEntry::Wgi8Wide, "next_n {next_n}");
        }
        // 9 rows: groups of 8 and 1 (4.5 on average); 12 rows: 8 and 4 (6).
        assert_eq!(decode(9), LogitsEntry::Wgi8Wide);
        assert_eq!(decode(12), LogitsEntry::Wgi8Wide);
        assert!(!groups_fill_wide(8, 2, 8) && groups_fill_wide(9, 2, 8));
        for v in Variant::all() {
            if matches!(v, Variant::Logits { .. }) && logits_kernel(v, h).0 != "mqa_logits_wgi8" {
                let one = logits_entry(v, h, 100, |_| unreachable!("{}: one entry", v.name()));
                assert_eq!(one, logits_kernel_for(v, h, false), "{}", v.name());
                assert_eq!(one.0.kernel(), logits_kernel(v, h).0, "{}", v.name());
            }
        }
    }

    /// Logits launches take up to 128 key tiles per block, fewer where that would leave
    /// fewer than 8 blocks per SM; the eight-row entry's launches run waves of 3 blocks
    /// per SM, at least 4 of them, whole where the tile cap does not bind.
    #[test]
    fn logits_launches_fill_the_gpu_several_waves_over() {
        #[cfg(feature = "tuning")]
        if std::env::var("DSA_CUDA_DEFINES").is_ok() {
            return; // LG_PER_BLOCK and LG_MIN_WAVES change the launch on purpose
        }
        let per = logits_launch_tiles_per_block;
        let sms = 132;
        let waves = |entry: LogitsEntry, chunks: usize, groups: usize| {
            let blocks = groups * chunks.div_ceil(per(entry, chunks, groups, sms));
            blocks as f64 / (LOGITS_WGI8_WIDE_BLOCKS_PER_SM * sms) as f64
        };
        // v41-1m's tiles: 64 rows at 256 MiB (8 groups of 8, 16384 key tiles): 1584
        // blocks of 83 tiles, 4.0 waves (at 128 tiles a block, 2.59).
        assert_eq!(per(LogitsEntry::Wgi8Wide, 16384, 8, sms), 83);
        assert!((3.95..=4.0).contains(&waves(LogitsEntry::Wgi8Wide, 16384, 8)));
        // 512 rows at 2 GiB (64 groups): the cap of 128 tiles binds, 20.7 waves.
        assert_eq!(per(LogitsEntry::Wgi8Wide, 16384, 64, sms), 128);
        assert!((20.6..=20.7).contains(&waves(LogitsEntry::Wgi8Wide, 16384, 64)));
        // v41-chunk's tiles of 2048 rows of 4096 key tiles.
        assert!((20.6..=20.7).contains(&waves(LogitsEntry::Wgi8Wide, 4096, 256)));
        // A small launch: one tile per block.
        assert_eq!(per(LogitsEntry::Wgi8Wide, 3, 1, sms), 1);
        // The other entries: at least 8 blocks per SM.
        assert_eq!(
            per(LogitsEntry::Wgi8, 16384, 16, sms),
            LOGITS_TILES_PER_BLOCK
        );
        assert_eq!(per(LogitsEntry::Wgi8, 1024, 64, sms), 62);
        assert_eq!(per(LogitsEntry::W16, 1024, 64, sms), 62);
        assert_eq!(per(LogitsEntry::Mma, 3, 1, sms), 1);
        // No group or SM count is a division by 0.
        assert_eq!(per(LogitsEntry::Mma, 3, 0, 0), 1);
        assert_eq!(per(LogitsEntry::Wgi8Wide, 3, 0, 0), 1);
    }

    /// A logits module holds the family file of its kernel and no other, and every
    /// kernel that can serve a variant has a source.
    #[test]
    fn logits_modules_hold_one_kernel_family() {
        let all = [
            "mqa_logits",
            "mqa_logits_wgr",
            "mqa_logits_wgi8",
            "mqa_logits_w16",
            "mqa_logits_w8",
        ];
        for v in Variant::all() {
            let serving = logits_kernels(v);
            if let Variant::Logits { .. } = v {
                assert_eq!(serving[0], "mqa_logits", "{}", v.name());
            }
            for kernel in all {
                let Some(src) = logits_source(v, kernel, Hooks::default()) else {
                    assert!(!serving.contains(&kernel), "{} {kernel}", v.name());
                    continue;
                };
                assert!(serving.contains(&kernel), "{} {kernel}", v.name());
                for other in all {
                    let defined = src.contains(&format!(") {other}(\n"));
                    assert_eq!(defined, other == kernel, "{} {kernel}: {other}", v.name());
                }
            }
        }
        assert!(logits_source(Variant::Topk, "mqa_logits", Hooks::default()).is_none());
        assert!(logits_source(
            Variant::logits(32, 4, Format::E2m1, Format::E2m1, false, Precision::Full),
            "mqa_logits_w16",
            Hooks::default()
        )
        .is_none());
    }
}
