//! Kernel sources (embedded), their variants, and NVRTC compilation for `sm_90a`.
//!
//! Every kernel is `kernels/common.cuh` + the variant's `#define`s + one `.cu` file,
//! compiled at run time by NVRTC with `--fmad=false --ftz=false` (SPEC 4 forbids
//! contracted multiply-adds and flushing subnormals) and no toolkit headers. Compilation
//! needs only libnvrtc, not a GPU: [`compile`] is what the NVRTC compile test calls.

use crate::error::{Error, Result};
use crate::problem::Format;

/// `kernels/common.cuh`.
pub const COMMON: &str = include_str!("../../kernels/common.cuh");
/// `kernels/logits.cu`.
pub const LOGITS: &str = include_str!("../../kernels/logits.cu");
/// `kernels/topk.cu`.
pub const TOPK: &str = include_str!("../../kernels/topk.cu");
/// `kernels/validate.cu`.
pub const VALIDATE: &str = include_str!("../../kernels/validate.cu");

/// Target architecture: Hopper with its arch-specific instructions.
pub const ARCH: &str = "sm_90a";

/// Rows per logits block (one warp each) for `H < 32`; must match `LG_ROWS` in `logits.cu`.
pub const LOGITS_ROWS: usize = 8;
/// Rows per logits block for `H >= 32` (register-bound: several 4-warp blocks per SM).
pub const LOGITS_ROWS_LARGE_H: usize = 4;

/// Rows per logits block for `heads` in this process: [`LOGITS_ROWS`] or
/// [`LOGITS_ROWS_LARGE_H`], or an `LG_ROWS=` override in `$DSA_CUDA_DEFINES` (1..=16;
/// the kernel gets the same define).
pub fn logits_rows(heads: usize) -> usize {
    let default = if heads >= 32 {
        LOGITS_ROWS_LARGE_H
    } else {
        LOGITS_ROWS
    };
    define_in("LG_ROWS", 1..=16).unwrap_or(default)
}
/// Whether the logits of this variant run on Hopper `wgmma` rather than `mqa_logits`
/// (`mma.sync`): `mqa_logits_wgr` for the exact class with `H = 32` and `D >= 64`,
/// `mqa_logits_w16` (f16 operands) for E4M3 x E4M3 with `H = 64`. `WGMMA=0` in
/// `$DSA_CUDA_DEFINES` turns both off (the `mma.sync` fallback, forced).
pub fn logits_wgmma(v: Variant) -> bool {
    let off = define_in("WGMMA", 0..=1) == Some(0);
    match v {
        Variant::Logits {
            heads,
            groups,
            q: Format::E2m1,
            k: Format::E2m1,
        } => heads == 32 && groups >= 2 && !off,
        Variant::Logits {
            heads,
            q: Format::E4m3,
            k: Format::E4m3,
            ..
        } => heads == 64 && !off,
        _ => false,
    }
}

/// Whether E4M3 x E4M3 with `H = 64` runs on fp8 `wgmma` (`mqa_logits_w8`, `W8=1` in
/// `$DSA_CUDA_DEFINES`, an A/B knob) rather than on f16 `wgmma` (`mqa_logits_w16`, the
/// default). Not the default because fp8 `wgmma` misses SPEC 4's bound when a subnormal
/// E4M3 operand is in a k32 step's product of largest exponent fields (measured `2^-6
/// M`; [`crate::cuda::FP8_WGMMA_TOLERANCE_LOG2`]). The two state different bounds:
/// [`crate::cuda::tolerance_log2`].
pub fn logits_fp8_wgmma() -> bool {
    define_in("W8", 0..=1) == Some(1)
}

/// Whether variant `v`'s logits kernel adds products on fp8 `wgmma`'s accumulator
/// (about 13 bits kept per addition): `mqa_logits_w8`.
pub fn logits_on_fp8_accumulator(v: Variant) -> bool {
    logits_kernel(v).0 == "mqa_logits_w8"
}

/// Rows per `mqa_logits_w16` (and `mqa_logits_w8`) block (`W16_ROWS`: 2 rows x 64 heads
/// = one 128-column MMA).
pub const LOGITS_W16_ROWS: usize = 2;

/// Rows per `mqa_logits_wgr` block (`WG_ROWS`: 2 rows x 32 heads = one 64-column MMA).
pub const LOGITS_WG_ROWS: usize = 2;

/// `$DSA_CUDA_DEFINES` (`NAME=VALUE` pairs separated by spaces; tuning knobs for
/// experiments, prepended to every kernel source as `#define`s), read once per process.
fn defines() -> &'static [(String, String)] {
    static DEFINES: std::sync::OnceLock<Vec<(String, String)>> = std::sync::OnceLock::new();
    DEFINES.get_or_init(|| {
        std::env::var("DSA_CUDA_DEFINES")
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    })
}

/// The first value of define `name` in [`defines`] that is a number in `range`.
fn define_in(name: &str, range: std::ops::RangeInclusive<usize>) -> Option<usize> {
    defines()
        .iter()
        .filter(|(k, _)| k == name)
        .filter_map(|(_, v)| v.parse::<usize>().ok())
        .find(|v| range.contains(v))
}

/// The logits kernel of variant `v`: entry name, rows per block, threads per block.
pub fn logits_kernel(v: Variant) -> (&'static str, usize, usize) {
    let (heads, exact) = match v {
        Variant::Logits { heads, q, k, .. } => (heads, q == Format::E2m1 && k == Format::E2m1),
        _ => (0, false),
    };
    if logits_wgmma(v) {
        if !exact {
            if logits_fp8_wgmma() {
                return ("mqa_logits_w8", LOGITS_W16_ROWS, 128);
            }
            return ("mqa_logits_w16", LOGITS_W16_ROWS, 128);
        }
        return ("mqa_logits_wgr", LOGITS_WG_ROWS, 128);
    }
    let rows = logits_rows(heads);
    ("mqa_logits", rows, rows * 32)
}

/// Keys per logits block; must match `LG_KEYS` in `logits.cu`.
pub const LOGITS_KEYS: usize = 64;
/// Threads of a top-k block; must match `TK_THREADS` in `topk.cu`.
pub const TOPK_THREADS: usize = 512;
/// Ids per top-k chunk of the ordered pass (`TK_THREADS * TK_ITEMS`).
pub const TOPK_CHUNK: usize = 512 * 8;
/// Largest `K` of the top-k fast path (`TK_SEL_CAP`); above it, the general path.
pub const TOPK_SEL_CAP: usize = 4096;
/// Keys of the threshold bin the fast path resolves in shared memory (`TK_CAND_CAP`).
pub const TOPK_CAND_CAP: usize = 3072;
/// Most key tiles one logits block walks (the launch gives each block up to this many
/// so that a block's query staging is paid once per that many tiles). 128: one call at
/// 28c5d16 measured v41-chunk's logits at 34.09 ms with 16 tiles, 32.23 with 32, 31.32
/// with 64, and v32-16k's at 3.99 with 16, 3.76 with 32; the next, at ca2744a, v41-chunk
/// end to end at 32.45 with 64 and 32.21 with 128, v32-16k at 4.12 and 4.08
/// (benches/RESULTS.md v12). The launch takes fewer tiles per block where more would
/// leave fewer than 8 x 132 blocks.
pub const LOGITS_TILES_PER_BLOCK: usize = 128;

/// [`LOGITS_TILES_PER_BLOCK`], or an `LG_PER_BLOCK=` override (1..=1024) in
/// `$DSA_CUDA_DEFINES` (a host-side A/B knob).
pub fn logits_tiles_per_block() -> usize {
    define_in("LG_PER_BLOCK", 1..=1024).unwrap_or(LOGITS_TILES_PER_BLOCK)
}

/// Rows of at most this many keys select from shared memory (the row's keys, 4 bytes
/// each, in the top-k block's dynamic shared memory): `topk.cu`'s shared-memory row.
pub const TOPK_SHORT_CAP: usize = 16384;

/// [`TOPK_SHORT_CAP`], or 0 under `TK_SHORT=0` in `$DSA_CUDA_DEFINES` (an A/B knob: every
/// row through the two-pass and general paths, launched as before the shared-memory row).
pub fn topk_short_cap() -> usize {
    if define_in("TK_SHORT", 0..=1) == Some(0) {
        0
    } else {
        TOPK_SHORT_CAP
    }
}
/// Path counters of the top-k kernels, in `topk.cu`'s `TK_PATH_*` order.
pub const TOPK_PATHS: [&str; 5] = ["ALL", "SHORT", "SAMPLED", "TWO", "GENERAL"];
/// Exact-class folding counters of the logits kernels, in `logits.cu`'s `LG_PATH_*`
/// order.
pub const LOGITS_PATHS: [&str; 4] = ["QFOLD", "QPLAIN", "ONE", "TWO"];
/// Threads of a block-keys block.
pub const BLOCK_KEYS_THREADS: usize = 256;
/// Threads of a `validate_inputs` block (`VAL_THREADS`, prepended to `validate.cu`).
pub const VALIDATE_THREADS: usize = 256;
/// Tensors one `validate_inputs` launch checks (`VAL_SEGS`): q or q_scale, k, k_scale,
/// weights, k_slots.
pub const VALIDATE_SEGMENTS: usize = 5;

/// One compiled module.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Variant {
    /// `mqa_logits` for `H` heads, `G = D/32` groups and a format pair.
    Logits {
        /// `H`.
        heads: usize,
        /// `D / 32`.
        groups: usize,
        /// Query format.
        q: Format,
        /// Key format.
        k: Format,
    },
    /// `topk_ragged_f32`, `block_keys_f32`, `kept_blocks_u32`, `decode_codes`.
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
    /// Every variant the backend can load: 4 head counts x 3 dims x 4 format pairs,
    /// top-k and validation.
    pub fn all() -> Vec<Variant> {
        let mut v = vec![Variant::Topk, Variant::Validate];
        for heads in [8, 16, 32, 64] {
            for groups in [1, 2, 4] {
                for q in [Format::E4m3, Format::E2m1] {
                    for k in [Format::E4m3, Format::E2m1] {
                        v.push(Variant::Logits {
                            heads,
                            groups,
                            q,
                            k,
                        });
                    }
                }
            }
        }
        v
    }

    /// A short name (`logits_h32_g4_e2m1_e2m1`, `topk`, `validate`).
    pub fn name(&self) -> String {
        match *self {
            Variant::Logits {
                heads,
                groups,
                q,
                k,
            } => format!("logits_h{heads}_g{groups}_{q}_{k}"),
            Variant::Topk => "topk".into(),
            Variant::Validate => "validate".into(),
        }
    }

    /// The full NVRTC source of this variant. `$DSA_CUDA_DEFINES` (`NAME=VALUE` pairs
    /// separated by spaces) is prepended as `#define`s: a tuning knob for experiments
    /// (e.g. `LG_MIN_BLOCKS=2`), read once per process.
    pub fn source(&self) -> String {
        let extra: String = defines()
            .iter()
            .map(|(k, v)| format!("#define {k} {v}\n"))
            .collect();
        extra + &self.source_plain()
    }

    fn source_plain(&self) -> String {
        match *self {
            Variant::Logits {
                heads,
                groups,
                q,
                k,
            } => format!(
                "#define DSA_H {heads}\n#define DSA_G {groups}\n#define DSA_QF {}\n#define DSA_KF {}\n{COMMON}\n{LOGITS}",
                fmt_code(q),
                fmt_code(k)
            ),
            Variant::Topk => format!("{COMMON}\n{TOPK}"),
            Variant::Validate => format!(
                "#define VAL_SEGS {VALIDATE_SEGMENTS}\n#define VAL_THREADS {VALIDATE_THREADS}\n{COMMON}\n{VALIDATE}"
            ),
        }
    }
}

/// Whether libnvrtc can be loaded (cudarc panics on first use otherwise).
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the library by its usual names; loads nothing else.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Compile one variant to PTX for [`ARCH`]. Needs libnvrtc, not a GPU.
pub fn compile(v: Variant) -> Result<cudarc::nvrtc::Ptx> {
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
        name: Some(format!("{}.cu", v.name())),
        options: vec!["-std=c++17".into()],
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(v.source(), opts).map_err(|e| {
        let detail = match &e {
            cudarc::nvrtc::CompileError::CompileError { log, .. } => {
                log.to_string_lossy().into_owned()
            }
            other => format!("{other:?}"),
        };
        Error::Backend {
            backend: "cuda",
            problem: format!("NVRTC failed on {}: {detail}", v.name()),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The host's copies of `topk.cu`'s constants and of both path-counter orders.
    #[test]
    fn topk_constants_match_the_kernel() {
        for (name, v) in [
            ("TK_THREADS", TOPK_THREADS),
            ("TK_SEL_CAP", TOPK_SEL_CAP),
            ("TK_CAND_CAP", TOPK_CAND_CAP),
            ("TK_PATHS", TOPK_PATHS.len()),
            ("TK_SHORT_CAP", TOPK_SHORT_CAP),
        ] {
            assert!(
                TOPK.contains(&format!("#define {name} {v}")),
                "{name} is not {v} in topk.cu"
            );
        }
        assert!(TOPK.contains("#define TK_ITEMS 8"));
        assert!(LOGITS.contains(&format!("#define LG_PATHS {}", LOGITS_PATHS.len())));
        for (i, name) in LOGITS_PATHS.iter().enumerate() {
            assert!(
                LOGITS.contains(&format!("#define LG_PATH_{name} {i}")),
                "LG_PATH_{name} is not {i} in logits.cu"
            );
        }
        assert_eq!(TOPK_CHUNK, TOPK_THREADS * 8);
        for (i, name) in TOPK_PATHS.iter().enumerate() {
            assert!(
                TOPK.contains(&format!("#define TK_PATH_{name} {i}")),
                "TK_PATH_{name} is not {i} in topk.cu"
            );
        }
    }
}
