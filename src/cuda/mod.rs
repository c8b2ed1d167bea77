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

pub mod bench;
pub mod kernels;

use std::sync::{Arc, Mutex};

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, CudaView, DevicePtr,
    LaunchConfig, PushKernelArg,
};

use crate::batch::Batch;
use crate::error::{Error, Result};
use crate::indexer::{Backend, RowFootprint};
use crate::plan::{Footprint, Plan};
use crate::problem::{Class, Format, Keys, Params, Problem, Queries, Role};
use crate::reference::Output;

pub use kernels::Variant;

/// Logits row length on the device: `n` rounded up to 16 floats (64-byte rows).
pub const ROW_ALIGN: usize = 16;

/// The relative part of the tolerance class's stated bound on this backend. In full,
/// for logit `[i, j]` ([`tolerance_bound`]):
///
/// `|x - ref| <= 2^TOLERANCE_LOG2 * M + A`, `A = (kscale_j * (G * sum_h |w_h| + H) + 2) * 2^-149`
///
/// with SPEC 4's `M`, `G = D / 32`, `kscale_j = 1` for E2M1 keys; 2^8 times tighter than
/// SPEC 4's `2^-8 * M` wherever `M` is not tiny, and what the tests and the
/// `cuda_vs_reference` fuzz target hold it to. `A` ([`tolerance_abs_term`]) covers f32
/// rounding in the subnormal range, where no relative bound can hold (fuzz/FINDINGS.md
/// F3: a logit of `5.77e-42` one subnormal ulp off, against `2^-16 * M = 3.9e-46`).
///
/// Derivation of the relative part: the tolerance-class kernels form the group sums on
/// f16 tensor cores with f32 accumulation, from operands exact in f16: `mma.sync` e4m3
/// (on sm_90 the SASS is `F2FP` unpacks of the E4M3 operands and two
/// `HMMA.16816.F32`), and `mqa_logits_w16`'s f16 `wgmma` (E4M3 x E4M3, H = 64; the E4M3
/// bytes converted by `cvt`): exact products, f32 sums (seen exact in a probe; assumed
/// here only to round each step to f32; the GPU test
/// `tolerance_fixed_case_448_squared_plus_31_times_14` holds every kernel to the bound
/// with products an accumulator keeping fewer than 24 bits would drop): at most
/// `D / 16 <= 8` roundings of partial sums bounded by the group magnitudes (one per k16
/// step on `wgmma`; `G <= 4` group steps on `mma.sync`). After that the GPU and the
/// reference do the f32 steps of the weight, the head sum and the key scale, each
/// contributing <= 2^-24 relative to `M`: the reference's pairwise head sum of <= 6
/// levels; the kernels' own head sum of SPEC 4's order (<= 6 levels), or for H = 64 on
/// `wgmma` (`tol_lane_heads`) an fma chain over a lane's 16 heads (<= 16
/// roundings) and two shuffle levels; and the reference rounds its exact group sum
/// once: in all at most (8 + 1 + 16 + 2 + 1 + 6 + 2) * 2^-24 * M < 2^-18.8 M.
/// The stated 2^-16 keeps a 7x margin while still catching an accumulator that keeps
/// only ~13 bits (as Hopper's fp8 `wgmma` does), whose errors are near 2^-13 M.
pub const TOLERANCE_LOG2: i32 = -16;

/// The relative part of the bound the tests hold `mqa_logits_w8` to (E4M3 x E4M3,
/// `H = 64` on fp8 `wgmma`; `W8=1` in `$DSA_CUDA_DEFINES`, an A/B knob, not the default):
/// SPEC 4's `2^-8 * M`, which it does **not** meet for every input.
///
/// What the H200 showed (GPU test `fp8_wgmma_accumulator_cases_meet_the_stated_bound`,
/// benches/RESULTS.md v11): one k32 `wgmma` step adds its 32 products in exact pairs, each
/// pair cut toward zero to the unit `2^(F + 1 - 13)`, where `F` is the largest sum of the
/// two operands' exponent fields among the step's products (a subnormal E4M3 counts as
/// `2^-6`), and a chained accumulator joins that alignment (`448^2 + 31 x 14` came back
/// `200944`; `256 + 31 x 0.0293` came back `256`). Hence:
///
/// - steps chained in the accumulator (`W8_SPLIT=0`) lose later steps' pairs to the
///   running sum's unit: `2^-6.85 M` measured at D = 128, past SPEC 4's bound;
/// - every step from a zero accumulator, the steps added in f32 (`W8_SPLIT=1`, the
///   kernel's default form): when the product of largest exponent fields is of two
///   normal values, a step loses less than 16 units `= 2^-8 * 2^F <= 2^-8` of the step's
///   `sum |q_d k_d|` (measured `2^-8.14`), inside the bound with a thin margin;
/// - but when that product has a subnormal operand its value can be 8 times (one side)
///   or 64 times (both) below `2^F`: `448 x 2^-9` with the other products just below
///   the unit lost them all, `2^-6 M` measured. No `2^-8 M` bound holds for such inputs,
///   and real fp8 keys and queries hold subnormal codes (quantised values below
///   `2^-6 * scale`), so f16 `wgmma` (`mqa_logits_w16`, [`TOLERANCE_LOG2`]) stays the
///   default.
pub const FP8_WGMMA_TOLERANCE_LOG2: i32 = -8;

/// The relative part of the bound for problem `p`'s logits on this backend:
/// [`TOLERANCE_LOG2`], or [`FP8_WGMMA_TOLERANCE_LOG2`] when `p`'s variant runs on the fp8
/// accumulator (only under the `W8=1` knob).
pub fn tolerance_log2(p: &Problem) -> i32 {
    let v = Variant::Logits {
        heads: p.heads,
        groups: p.dim / 32,
        q: p.q_format(),
        k: p.k_format(),
    };
    if kernels::logits_on_fp8_accumulator(v) {
        FP8_WGMMA_TOLERANCE_LOG2
    } else {
        TOLERANCE_LOG2
    }
}

/// f32's least subnormal, `2^-149`: the unit of the bound's absolute term.
pub const F32_SUBNORMAL_ULP: f64 = f32::from_bits(1) as f64;

/// The tolerance class's stated bound for one logit of magnitude `magnitude` (SPEC 4's
/// `M`) and absolute term `abs_term` ([`tolerance_abs_term`]) on the kernels that add in
/// f32 (every variant but the fp8 accumulator's: [`logit_bound`] picks):
/// `2^TOLERANCE_LOG2 * magnitude + abs_term`. In f64, as the tests compare
/// `|x - ref|` (f64) with it.
pub fn tolerance_bound(magnitude: f64, abs_term: f64) -> f64 {
    2f64.powi(TOLERANCE_LOG2) * magnitude + abs_term
}

/// The absolute term of the tolerance bound,
/// `A = (kscale_j * (G * sum_h |w_h| + H) + 2) * 2^-149`, for key scale `kscale`
/// (1 for E2M1 keys), `sum_abs_weights = sum_h |w[i, h]|`, `groups = G = D / 32` and
/// `heads = H`.
///
/// Why absolute: one f32 rounding of a real `y` errs by at most `2^-24 |y|` when
/// `|y| >= 2^-126`, but below that by up to half the least subnormal, `2^-150`, however
/// small `y` is (and never by more than `|y|`: 0 is representable). The relative part
/// `2^TOLERANCE_LOG2 * M` covers the first kind; `A` the second. `|x - ref|` collects
/// both sides' errors. The f32 products of SPEC 4's steps 2-4 that can round in the
/// subnormal range (each by `<= 2^-150` where it is made), and what multiplies them
/// afterwards:
///
/// - `a_h`: the device's `<= G` scale products `s_g * c_g` (one per group, in the f32
///   form) and the reference's one rounding of its exact sum: `G + 1` per head, each
///   then multiplied by `|w_h| * kscale_j`;
/// - `term_h = w_h * relu(a_h)`: one per head on each side, then times `kscale_j`;
/// - `logit * kscale_j` (E4M3 keys): one on each side.
///
/// Sum over heads: `(G + 1) * kscale_j * sum_h |w_h| + 2 H kscale_j + 2` half-ulps, that
/// is `(kscale_j * ((G + 1) / 2 * sum_h |w_h| + H) + 1) * 2^-149 <= A` (`G >= 1`).
/// Steps with no absolute term: the group sums (E4M3 and E2M1 products are multiples of
/// `2^-18`, never subnormal, so MMA accumulation rounds relatively) and every sum of
/// the head tree (two f32 whose exact sum is below `2^-125` are multiples of `2^-149`
/// with a sum of at most 24 significant bits: exact; above, the rounding is relative).
/// `relu` does not enlarge a difference. The device row allows the f32 form
/// `f32(s_g) * c_g` per group; the current kernel forms `a_h` as the reference does (f64
/// products, one rounding), i.e. one step, not `G`. Second order: each later f32 step
/// scales an earlier error by at most `1 + 2^-24`, at most 20 steps (term product, the
/// head sum's <= 16 fma and 2 shuffle levels, key scale): `(1 + 2^-24)^20 - 1 < 2^-19.6`.
/// Each absolute error is at most the value rounded, itself at most its share of `M`
/// (about `G + 5 <= 9` shares in all), so the excess is below `9 * 2^-19.6 M < 2^-16.4 M`:
/// inside the margin of the relative part (`2^-16 M` stated against `< 2^-18.8 M`
/// derived leaves more than `2^-16.3 M`). Flush-to-zero (an
/// error up to `2^-126` per step) stays far outside `A` unless
/// `kscale_j * (G * sum_h |w_h| + H)` nears `2^23`.
pub fn tolerance_abs_term(kscale: f64, sum_abs_weights: f64, groups: usize, heads: usize) -> f64 {
    (kscale * (groups as f64 * sum_abs_weights + heads as f64) + 2.0) * F32_SUBNORMAL_ULP
}

/// The stated bound of logit `[i, j]` (row `i`, request-local visible key `j`) of a
/// tolerance-class problem `p` whose SPEC 4 magnitude `M` is `magnitude` (the caller
/// computes `M`: the tests do it independently of the crate):
/// `2^tolerance_log2(p) * M + A` ([`tolerance_log2`], [`tolerance_abs_term`]).
pub fn logit_bound(p: &Problem, i: usize, j: usize, magnitude: f64) -> f64 {
    let kscale = match p.inputs.k {
        Keys::E4m3 { scale, .. } => scale[p.batch.rows()[i].ks + j] as f64,
        Keys::E2m1 { .. } => 1.0,
    };
    let sum_abs_weights: f64 = p
        .inputs
        .weights
        .row(i)
        .iter()
        .map(|&w| (w as f64).abs())
        .sum();
    2f64.powi(tolerance_log2(p)) * magnitude
        + tolerance_abs_term(kscale, sum_abs_weights, p.dim / 32, p.heads)
}

/// Alignment, in bytes, that [`Engine::run_device`] requires of the query and key
/// tensors' device addresses.
pub const INPUT_ALIGN: usize = 16;

/// Largest `K` the device top-k supports.
pub const MAX_TOPK: usize = 1 << 16;

/// Dynamic shared memory the consumer bitmap may take (bytes).
const MAX_BITMAP_BYTES: usize = 160 * 1024;

/// Dynamic shared memory a top-k block may take (bytes): the limit of sm_90 (227 KiB)
/// less the kernels' static 42 KiB.
const MAX_TOPK_DYNAMIC_SMEM: usize = 184 * 1024;

/// How many row selections each top-k path made in a run (read back by
/// [`Backend::end`]; a row split into segments counts once per segment and once for
/// the merge). Tests assert with it which path their rows took.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TopkPaths {
    /// At most `K` candidates: every one taken, no score compared.
    pub all: u64,
    /// The row's keys in shared memory (rows of at most [`kernels::TOPK_SHORT_CAP`] keys).
    pub short: u64,
    /// Sampled threshold: one pass over the row.
    pub sampled: u64,
    /// Two passes: an 11-bit histogram, then the threshold bin in shared memory.
    pub two_pass: u64,
    /// Four digit passes over the row (K above the fast path's cap, or a crowded bin).
    pub general: u64,
}

impl TopkPaths {
    /// Each count over `runs` (counters summed over repeated runs of one problem).
    pub fn per_run(self, runs: u64) -> TopkPaths {
        let d = |x: u64| x / runs.max(1);
        TopkPaths {
            all: d(self.all),
            short: d(self.short),
            sampled: d(self.sampled),
            two_pass: d(self.two_pass),
            general: d(self.general),
        }
    }
}

/// What the exact-class logits kernels did in a run (read back by [`Backend::end`];
/// zero outside the exact class). Tests assert with it on which side of the scale-folding
/// edges a launch fell (kernels/logits.cu).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FoldCounts {
    /// Blocks whose queries folded their scales into the MMA operands.
    pub query_blocks_folded: u64,
    /// Blocks whose queries did not.
    pub query_blocks_plain: u64,
    /// Threads whose key tiles all ran one multiply per group: folded key tiles, or, in
    /// `mqa_logits_wgr`, each key's `C = 2^(ebq_g - 129) * 2^(ek - 127)`.
    pub threads_one_multiply: u64,
    /// Threads of which some key tile ran the reference's two multiplies.
    pub threads_two_multiplies: u64,
}

impl FoldCounts {
    /// Each count over `runs` (counters summed over repeated runs of one problem).
    pub fn per_run(self, runs: u64) -> FoldCounts {
        let d = |x: u64| x / runs.max(1);
        FoldCounts {
            query_blocks_folded: d(self.query_blocks_folded),
            query_blocks_plain: d(self.query_blocks_plain),
            threads_one_multiply: d(self.threads_one_multiply),
            threads_two_multiplies: d(self.threads_two_multiplies),
        }
    }
}

/// Per-row metadata bytes on the device: `n`, `ks` (u32), tile offset (u64), published
/// index (i32), block-key offset (u64), and up to one 16-byte row group per row.
const META_BYTES_PER_ROW: usize = 4 + 4 + 8 + 4 + 8 + 16;

fn backend_err(problem: impl Into<String>) -> Error {
    Error::Backend {
        backend: "cuda",
        problem: problem.into(),
    }
}

fn drv(what: &str) -> impl FnOnce(cudarc::driver::DriverError) -> Error + '_ {
    move |e| backend_err(format!("{what}: {e:?}"))
}

/// Whether libcuda and libnvrtc can be loaded (checked before any cudarc call, which
/// would panic without them).
pub fn libraries_present() -> bool {
    // SAFETY: only tries to dlopen libcuda by its usual names.
    let cuda = unsafe { cudarc::driver::sys::is_culib_present() };
    cuda && kernels::nvrtc_present()
}

/// Every code of each format as the device decodes it ([`Device::decode_codes`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodedCodes {
    /// E4M3 byte `b` -> f32 bits, `[256]`.
    pub e4m3: Vec<u32>,
    /// E2M1 code -> the E4M3 byte of twice its value (the exact class's MMA operand), `[16]`.
    pub e2m1_doubled: Vec<u32>,
    /// E2M1 code -> the E4M3 byte of its value (tolerance-class operand), `[16]`.
    pub e2m1: Vec<u32>,
    /// UE8M0 byte -> f32 bits, `[256]`.
    pub ue8m0: Vec<u32>,
}

/// A CUDA device: its context, a stream, and the compiled modules of this process.
#[derive(Debug)]
pub struct Device {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    modules: Mutex<Vec<(Variant, Arc<CudaModule>)>>,
}

impl Device {
    /// Open device `ordinal` (an sm_90 GPU) with a new stream.
    pub fn new(ordinal: usize) -> Result<Arc<Device>> {
        if !libraries_present() {
            return Err(backend_err(
                "no CUDA: libcuda or libnvrtc not found (driver and NVRTC 13.0 needed)",
            ));
        }
        let n = CudaContext::device_count().map_err(drv("cuDeviceGetCount"))?;
        if n <= 0 {
            return Err(backend_err("no CUDA device found"));
        }
        if ordinal >= n as usize {
            return Err(Error::range(
                "device",
                ordinal,
                "an existing CUDA device ordinal",
            ));
        }
        let ctx = CudaContext::new(ordinal).map_err(drv("cuCtxCreate"))?;
        let stream = ctx.new_stream().map_err(drv("cuStreamCreate"))?;
        Device::with_stream(stream)
    }

    /// Use a caller's stream (and its context): the engine API.
    pub fn with_stream(stream: Arc<CudaStream>) -> Result<Arc<Device>> {
        let ctx = stream.context().clone();
        let (major, minor) = ctx
            .compute_capability()
            .map_err(drv("compute capability"))?;
        if (major, minor) != (9, 0) {
            return Err(backend_err(format!(
                "GPU {} is sm_{major}{minor}; the kernels are built and tested for sm_90a (H100/H200) only",
                ctx.name().unwrap_or_default()
            )));
        }
        Ok(Arc::new(Device {
            ctx,
            stream,
            modules: Mutex::new(Vec::new()),
        }))
    }

    /// The default device 0, opened once per process.
    pub fn shared() -> Result<Arc<Device>> {
        static DEV: Mutex<Option<Arc<Device>>> = Mutex::new(None);
        let mut g = DEV
            .lock()
            .map_err(|_| backend_err("device lock poisoned"))?;
        if let Some(d) = g.as_ref() {
            return Ok(d.clone());
        }
        let d = Device::new(0)?;
        *g = Some(d.clone());
        Ok(d)
    }

    /// The stream every launch of this device goes to.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// GPU name.
    pub fn name(&self) -> String {
        self.ctx.name().unwrap_or_default()
    }

    fn module(&self, v: Variant) -> Result<Arc<CudaModule>> {
        {
            let g = self
                .modules
                .lock()
                .map_err(|_| backend_err("module cache poisoned"))?;
            if let Some((_, m)) = g.iter().find(|(k, _)| *k == v) {
                return Ok(m.clone());
            }
        }
        // Compile outside the lock; a racing thread may compile the same variant.
        static NVRTC_CACHE: Mutex<Vec<(Variant, String)>> = Mutex::new(Vec::new());
        let cached = NVRTC_CACHE
            .lock()
            .ok()
            .and_then(|g| g.iter().find(|(k, _)| *k == v).map(|(_, p)| p.clone()));
        let src = match cached {
            Some(s) => s,
            None => {
                let s = kernels::compile(v)?.to_src();
                if let Ok(mut g) = NVRTC_CACHE.lock() {
                    g.push((v, s.clone()));
                }
                s
            }
        };
        let m = self
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(src))
            .map_err(drv("cuModuleLoadData"))?;
        let mut g = self
            .modules
            .lock()
            .map_err(|_| backend_err("module cache poisoned"))?;
        g.push((v, m.clone()));
        Ok(m)
    }

    /// A kernel of a variant.
    pub fn function(&self, v: Variant, name: &str) -> Result<CudaFunction> {
        self.module(v)?
            .load_function(name)
            .map_err(drv("cuModuleGetFunction"))
    }

    /// Decode every code of the three formats on the device (the codec test).
    pub fn decode_codes(&self) -> Result<DecodedCodes> {
        let f = self.function(Variant::Topk, "decode_codes")?;
        let s = &self.stream;
        let mut a = s.alloc_zeros::<u32>(256).map_err(drv("alloc"))?;
        let mut b = s.alloc_zeros::<u32>(16).map_err(drv("alloc"))?;
        let mut c = s.alloc_zeros::<u32>(16).map_err(drv("alloc"))?;
        let mut d = s.alloc_zeros::<u32>(256).map_err(drv("alloc"))?;
        let mut l = s.launch_builder(&f);
        l.arg(&mut a).arg(&mut b).arg(&mut c).arg(&mut d);
        // SAFETY: the kernel writes out[0..256] / out[0..16] of buffers of those lengths.
        unsafe {
            l.launch(LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .map_err(drv("launch decode_codes"))?;
        let get = |x: &CudaSlice<u32>| s.clone_dtoh(x).map_err(drv("copy back"));
        Ok(DecodedCodes {
            e4m3: get(&a)?,
            e2m1_doubled: get(&b)?,
            e2m1: get(&c)?,
            ue8m0: get(&d)?,
        })
    }
}

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

/// Shape of a layer as the kernels see it.
#[derive(Debug, Clone, Copy)]
struct Shape {
    heads: usize,
    dim: usize,
    q: Format,
    k: Format,
    topk: usize,
    page_cols: usize,
    block_size: usize,
    num_blocks: usize,
    tail: Option<Option<usize>>, // Some(tail) for a source
    consumer: bool,
}

impl Shape {
    /// The logits module of this layer.
    fn logits_variant(&self) -> Variant {
        Variant::Logits {
            heads: self.heads,
            groups: self.dim / 32,
            q: self.q,
            k: self.k,
        }
    }
}

fn ptr<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    let (p, _g) = s.device_ptr(stream);
    p
}

fn vptr<T>(s: &CudaView<'_, T>, stream: &CudaStream) -> u64 {
    let (p, _g) = s.device_ptr(stream);
    p
}

/// Per-tile launch geometry, computed once on the host in `begin`.
#[derive(Debug, Clone)]
struct TileGeom {
    groups: std::ops::Range<usize>,
    chunks: u32,
    max_blocks: usize,
    rows: std::ops::Range<usize>,
    segments: usize,
    /// Shared-memory row capacity of the top-k launch for the tile's rows of at most
    /// [`kernels::TOPK_SHORT_CAP`] keys (the longest such row with more than K keys,
    /// rounded up to 8; 0: none).
    short_cap: u32,
    /// The tile's longest row (keys).
    max_n: usize,
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

/// Rows x segments of a tile whose top-k is split across blocks (tiles of fewer than
/// [`SPLIT_ROWS`] rows): at most this many segment selections of `K` ids each.
const SPLIT_SEGMENTS: usize = 2 * 132;
/// The path counters on the device: the top-k's, then the logits kernels'.
const PATHS_BYTES: usize = (kernels::TOPK_PATHS.len() + kernels::LOGITS_PATHS.len()) * 4;
/// Tiles with fewer rows than this split each row's top-k across several blocks.
const SPLIT_ROWS: usize = 132;

/// The footprint of the device for a problem with `rows` rows and `K = topk`: the
/// per-row metadata and the split top-k's segment scratch (`SPLIT_SEGMENTS * K` ids).
fn footprint(rows: usize, topk: usize) -> RowFootprint {
    RowFootprint {
        align: ROW_ALIGN,
        workers: 1,
        worker_bytes: rows
            .saturating_mul(META_BYTES_PER_ROW)
            .saturating_add(SPLIT_SEGMENTS.saturating_mul(topk).saturating_mul(4))
            .saturating_add(PATHS_BYTES),
    }
}

/// Segments per row for a tile of `rows` rows whose longest row has `max_n` keys
/// (1: no split). Each segment keeps at least 8 K keys.
fn split_segments(rows: usize, max_n: usize, topk: usize) -> usize {
    if rows == 0 || rows >= SPLIT_ROWS {
        return 1;
    }
    (SPLIT_SEGMENTS / rows)
        .min(16)
        .min(max_n / (8 * topk.max(1)))
        .max(1)
}

/// The shared-memory row capacity (keys) of a tile's short-row top-k launch: the longest
/// of the tile's rows `ns` with `topk < n <= short` keys, rounded up to 8 (the kernel
/// reads the row 8 keys at a time), or 0 when there is none or when it would not fit the
/// dynamic shared memory beside a consumer's bitmap of `bitmap_words`. The tile's rows of
/// at most this many keys take `topk_short_f32`, the others `topk_ragged_f32`.
fn short_row_cap(
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

/// Dynamic shared memory (bytes) of a `topk_short_f32` launch: the consumer bitmap's
/// `bitmap_words`, rounded up to 16 bytes, then `row_cap` keys (`topk.cu`'s layout).
fn short_launch_smem(bitmap_words: u32, row_cap: usize) -> usize {
    (bitmap_words as usize).next_multiple_of(4) * 4 + row_cap * 4
}

/// Check what the kernels support, before any allocation.
fn check_shape(s: &Shape, batch: &Batch) -> Result<()> {
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
    if s.consumer {
        let max_n = batch.rows().iter().map(|r| r.n).max().unwrap_or(0);
        let bytes = max_n.div_ceil(s.block_size).div_ceil(32) * 4;
        if bytes > MAX_BITMAP_BYTES {
            return Err(Error::range(
                "block_size",
                s.block_size,
                "consumer rows need ceil(n / B) / 8 <= 160 KiB of shared memory on the CUDA backend",
            ));
        }
    }
    Ok(())
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

// ---------------------------------------------------------------------------------
// The host-input backend.
// ---------------------------------------------------------------------------------

/// The CUDA backend for host inputs: uploads them once per run, keeps the outputs on
/// the device until [`Backend::end`].
pub struct CudaBackend {
    dev: Arc<Device>,
    run: Option<Run>,
    peak: usize,
    paths: TopkPaths,
    folds: FoldCounts,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("device", &self.dev.name())
            .field("peak", &self.peak)
            .finish()
    }
}

impl CudaBackend {
    /// On the process's shared device 0.
    pub fn new() -> Result<Self> {
        Ok(CudaBackend::on(Device::shared()?))
    }

    /// On a given device.
    pub fn on(dev: Arc<Device>) -> Self {
        CudaBackend {
            dev,
            run: None,
            peak: 0,
            paths: TopkPaths::default(),
            folds: FoldCounts::default(),
        }
    }

    /// The device.
    pub fn device(&self) -> &Arc<Device> {
        &self.dev
    }

    /// Transient device bytes of the last run (logits tile, block keys, metadata, split
    /// top-k scratch).
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
        let fp = footprint(p.batch.num_rows(), p.topk);
        for t in 0..plan.tiles.len() {
            let run = self.run.as_mut().ok_or_else(|| backend_err("no run"))?;
            run.tile(&self.dev, t)?;
            let Some(l) = run.logits.as_ref() else {
                continue;
            };
            let all = self
                .dev
                .stream
                .clone_dtoh(l)
                .map_err(drv("copy logits back"))?;
            let mut off = 0usize;
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
        let fp = footprint(p.batch.num_rows(), p.topk);
        let mut src = 0usize;
        for t in 0..plan.tiles.len() {
            let run = self.run.as_mut().ok_or_else(|| backend_err("no run"))?;
            if let Some(l) = run.logits.as_mut() {
                let mut host = vec![0f32; l.len()];
                let mut off = 0usize;
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

fn upload<T: cudarc::driver::DeviceRepr + Copy>(
    s: &Arc<CudaStream>,
    v: ndarray::ArrayViewD<'_, T>,
    what: &str,
) -> Result<CudaSlice<T>> {
    let host: Vec<T> = match v.as_slice() {
        Some(x) => x.to_vec(),
        None => v.iter().copied().collect(),
    };
    if host.is_empty() {
        // A zero-length allocation is not allowed: one element that nothing reads.
        return s.alloc_zeros_like_one::<T>(what);
    }
    s.clone_htod(&host).map_err(drv(what))
}

trait AllocOne {
    fn alloc_zeros_like_one<T: cudarc::driver::DeviceRepr>(
        &self,
        what: &str,
    ) -> Result<CudaSlice<T>>;
}
impl AllocOne for Arc<CudaStream> {
    fn alloc_zeros_like_one<T: cudarc::driver::DeviceRepr>(
        &self,
        what: &str,
    ) -> Result<CudaSlice<T>> {
        // SAFETY: an uninitialised one-element buffer that no kernel reads (its length
        // stands for an empty input).
        unsafe { self.alloc::<T>(1) }.map_err(drv(what))
    }
}

fn shape_of(p: &Problem) -> Shape {
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
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }
    fn max_topk(&self) -> usize {
        MAX_TOPK
    }
    fn footprint(&self, p: &Problem) -> RowFootprint {
        footprint(p.batch.num_rows(), p.topk)
    }
    fn begin(&mut self, p: &Problem, plan: &Plan) -> Result<()> {
        let shape = shape_of(p);
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
        let s = self.dev.stream.clone();
        let mut owned = Vec::new();
        let mut ptrs = Ptrs::default();
        let keep_u8 = |v: CudaSlice<u8>, owned: &mut Vec<OwnedBuf>| {
            let a = ptr(&v, &s);
            owned.push(OwnedBuf::U8(v));
            a
        };
        match p.inputs.q {
            Queries::E4m3(q) => ptrs.q = keep_u8(upload(&s, q.into_dyn(), "upload q")?, &mut owned),
            Queries::E2m1 { packed, scale } => {
                ptrs.q = keep_u8(upload(&s, packed.into_dyn(), "upload q")?, &mut owned);
                ptrs.q_scale = keep_u8(upload(&s, scale.into_dyn(), "upload q_scale")?, &mut owned);
            }
        }
        match p.inputs.k {
            Keys::E4m3 { codes, scale } => {
                ptrs.k = keep_u8(upload(&s, codes.into_dyn(), "upload k")?, &mut owned);
                let ks = upload(&s, scale.into_dyn(), "upload k_scale")?;
                ptrs.k_scale32 = ptr(&ks, &s);
                owned.push(OwnedBuf::F32(ks));
            }
            Keys::E2m1 { packed, scale } => {
                ptrs.k = keep_u8(upload(&s, packed.into_dyn(), "upload k")?, &mut owned);
                ptrs.k_scale8 =
                    keep_u8(upload(&s, scale.into_dyn(), "upload k_scale")?, &mut owned);
            }
        }
        let w = upload(&s, p.inputs.weights.into_dyn(), "upload weights")?;
        ptrs.w = ptr(&w, &s);
        owned.push(OwnedBuf::F32(w));
        if let Some(slots) = p.inputs.k_slots {
            let v = upload(&s, slots.into_dyn(), "upload k_slots")?;
            ptrs.k_slots = ptr(&v, &s);
            owned.push(OwnedBuf::I32(v));
        }
        if let Role::Consumer(c) = p.role {
            let v = upload(&s, c.blocks.view().into_dyn(), "upload candidates")?;
            ptrs.cblocks = ptr(&v, &s);
            owned.push(OwnedBuf::I32(v));
        }
        let publishes = |i: usize| p.publishes(i);
        let run = Run::begin(&self.dev, p.batch, shape, ptrs, owned, plan, &publishes)?;
        self.peak = run.transient;
        self.run = Some(run);
        Ok(())
    }
    fn tile(&mut self, _p: &Problem, _plan: &Plan, t: usize, _out: &mut Output) -> Result<()> {
        let run = self
            .run
            .as_mut()
            .ok_or_else(|| backend_err("tile before begin"))?;
        run.tile(&self.dev, t)
    }
    fn end(&mut self, _p: &Problem, out: &mut Output) -> Result<()> {
        let Some(run) = self.run.take() else {
            return Ok(());
        };
        let s = &self.dev.stream;
        let copy = |d: &CudaSlice<i32>, h: &mut ndarray::Array2<i32>, what: &str| -> Result<()> {
            let v = s.clone_dtoh(d).map_err(drv(what))?;
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
        let c = s
            .clone_dtoh(&run.paths)
            .map_err(drv("copy path counters back"))?;
        self.paths = TopkPaths {
            all: c[0].into(),
            short: c[1].into(),
            sampled: c[2].into(),
            two_pass: c[3].into(),
            general: c[4].into(),
        };
        let f = &c[kernels::TOPK_PATHS.len()..];
        self.folds = FoldCounts {
            query_blocks_folded: f[0].into(),
            query_blocks_plain: f[1].into(),
            threads_one_multiply: f[2].into(),
            threads_two_multiplies: f[3].into(),
        };
        s.synchronize().map_err(drv("synchronize"))?;
        Ok(())
    }
    fn device_peak(&self) -> Option<usize> {
        Some(self.peak)
    }
}

/// Run problem `p` on the shared CUDA device in tiles whose logits fit `budget` bytes.
pub fn run_cuda(p: &Problem, budget: usize) -> Result<(Output, Plan)> {
    let mut b = CudaBackend::new()?;
    crate::indexer::run(&mut b, p, budget)
}

// ---------------------------------------------------------------------------------
// The engine API: inputs already on the device, the caller's stream.
// ---------------------------------------------------------------------------------

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
/// [`Problem::new`] gives for the same host arrays. Consumer candidates are checked for
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
    dev: Arc<Device>,
}

impl Engine {
    /// On the caller's stream (its context must be an sm_90 GPU).
    pub fn on_stream(stream: Arc<CudaStream>) -> Result<Engine> {
        if !libraries_present() {
            return Err(backend_err("no CUDA: libcuda or libnvrtc not found"));
        }
        Ok(Engine {
            dev: Device::with_stream(stream)?,
        })
    }

    /// Run a plain or source layer (`tail`: `None` plain, `Some(t)` source) whose
    /// inputs are on the device; the outputs stay there. Consumer layers take
    /// `candidates` (`[T, NB]` on the device).
    ///
    /// After the host checks, one kernel scans the inputs' values (SPEC 8) and the host
    /// reads back its 8-byte verdict: the call waits once for the engine's stream (and
    /// the work queued on it before), then queues the run and returns without waiting
    /// again (outputs are ready in stream order). A bad value is the error
    /// [`Problem::new`] gives for the same host arrays (the first offender in its order
    /// of checks: q or q_scale, k, k_scale, weights, k_slots), and nothing runs.
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
        let s = self.dev.stream.clone();
        let (t, l) = (batch.num_rows(), batch.num_keys());
        let (h, d) = (inputs.heads, inputs.dim);
        if !(h.is_power_of_two() && (8..=64).contains(&h)) {
            return Err(Error::range("heads", h, "a power of two in 8..=64"));
        }
        if ![32, 64, 128].contains(&d) {
            return Err(Error::range("dim", d, "32, 64 or 128"));
        }
        let g = d / 32;
        let len = |field: &str, got: usize, want: usize| -> Result<()> {
            if got != want {
                return Err(Error::shape(field, &[got], &[want]));
            }
            Ok(())
        };
        let mut ptrs = Ptrs::default();
        let qf = match &inputs.q {
            DeviceQueries::E4m3(q) => {
                len("q", q.len(), t * h * d)?;
                ptrs.q = vptr(q, &s);
                Format::E4m3
            }
            DeviceQueries::E2m1 { packed, scale } => {
                len("q", packed.len(), t * h * d / 2)?;
                len("q_scale", scale.len(), t * h * g)?;
                ptrs.q = vptr(packed, &s);
                ptrs.q_scale = vptr(scale, &s);
                Format::E2m1
            }
        };
        let kf = match &inputs.k {
            DeviceKeys::E4m3 { codes, scale } => {
                len("k", codes.len(), l * d)?;
                len("k_scale", scale.len(), l)?;
                ptrs.k = vptr(codes, &s);
                ptrs.k_scale32 = vptr(scale, &s);
                Format::E4m3
            }
            DeviceKeys::E2m1 { packed, scale } => {
                len("k", packed.len(), l * d / 2)?;
                len("k_scale", scale.len(), l * g)?;
                ptrs.k = vptr(packed, &s);
                ptrs.k_scale8 = vptr(scale, &s);
                Format::E2m1
            }
        };
        len("weights", inputs.weights.len(), t * h)?;
        ptrs.w = vptr(&inputs.weights, &s);
        if let Some(slots) = &inputs.k_slots {
            len("k_slots", slots.len(), l)?;
            ptrs.k_slots = vptr(slots, &s);
        }
        if params.topk == 0 {
            return Err(Error::range("topk", 0, "1 ..= 65536"));
        }
        let page_cols = match params.page_cols {
            Some(c) if c < params.topk => {
                return Err(Error::range("page_cols", c, "page_cols >= topk"))
            }
            Some(c) => c,
            None => params.topk.div_ceil(64) * 64,
        };
        if params.block_size == 0 {
            return Err(Error::range("block_size", 0, "block_size >= 1"));
        }
        if params.num_blocks == 0 {
            return Err(Error::range("num_blocks", 0, "num_blocks >= 1"));
        }
        if let Some(Some(0)) = source_tail {
            return Err(Error::range("tail", 0, "tail >= 1"));
        }
        if let Some(c) = candidates {
            len("candidates", c.len(), t * params.num_blocks)?;
            ptrs.cblocks = vptr(c, &s);
        }
        let shape = Shape {
            heads: h,
            dim: d,
            q: qf,
            k: kf,
            topk: params.topk,
            page_cols,
            block_size: params.block_size,
            num_blocks: params.num_blocks,
            tail: source_tail,
            consumer: candidates.is_some(),
        };
        check_shape(&shape, batch)?;
        let pp = crate::plan::PlanParams {
            heads: h,
            dim: d,
            topk: params.topk,
            block_size: params.block_size,
            num_blocks: params.num_blocks,
            role: match (source_tail, candidates) {
                (Some(tail), _) => crate::plan::PlanRole::Source { tail },
                (None, Some(_)) => crate::plan::PlanRole::Consumer,
                _ => crate::plan::PlanRole::Plain,
            },
            budget,
        };
        let plan = crate::plan::plan(batch, &pp, &footprint(t, params.topk))?;
        // SPEC 8's value checks, in Problem::new's order (keys too when there are no rows).
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
        }
        checked.push(Checked::Weights(&inputs.weights));
        if let Some(slots) = &inputs.k_slots {
            checked.push(Checked::Slots(slots));
        }
        validate(&self.dev, &checked)?;
        // The kernels read query and key rows with 16-byte (and 4-byte) vector loads:
        // their tensors must start on a 16-byte boundary (every cudarc allocation does;
        // a view into one need not). Checked after the values, so that a bad value is
        // reported as Problem::new reports it, wherever it sits.
        for (field, addr) in [("q", ptrs.q), ("k", ptrs.k)] {
            if addr % INPUT_ALIGN as u64 != 0 {
                return Err(Error::range(
                    field,
                    format!("device address {addr:#x}"),
                    "a 16-byte aligned device address (the start of an allocation, or a view at a multiple of 16 bytes)",
                ));
            }
        }
        if t == 0 {
            let none = |what: &str| s.null::<i32>().map_err(drv(what));
            return Ok(DeviceOutput {
                raw: none("empty raw")?,
                page: none("empty page")?,
                published: match source_tail {
                    Some(_) => Some(none("empty published")?),
                    None => None,
                },
                plan,
                measured_peak: 0,
            });
        }
        let publishes = |i: usize| {
            source_tail.is_some_and(|tail| {
                crate::batch::publishes(&batch.rows()[i], batch.requests(), tail)
            })
        };
        let mut run = Run::begin(&self.dev, batch, shape, ptrs, Vec::new(), &plan, &publishes)?;
        for ti in 0..plan.tiles.len() {
            run.tile(&self.dev, ti)?;
        }
        let measured_peak = run.transient;
        Ok(DeviceOutput {
            raw: run.raw,
            page: run.page,
            published: run.published,
            plan,
            measured_peak,
        })
    }
}

// ---------------------------------------------------------------------------------
// SPEC 8's value checks of device inputs (the engine API): kernels/validate.cu.
// ---------------------------------------------------------------------------------

/// One tensor of a `validate_inputs` launch (`ValSeg` in `kernels/validate.cu`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct ValSeg {
    /// Device address, a multiple of the element size.
    ptr: u64,
    /// Elements.
    len: u64,
    /// `VAL_E4M3` .. `VAL_NONNEG` of the kernel.
    kind: u32,
    pad: u32,
}

/// The kernel's by-value argument (`ValSegs`): unused segments have `len = 0`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct ValSegs {
    s: [ValSeg; kernels::VALIDATE_SEGMENTS],
}

const _: () = assert!(
    std::mem::size_of::<ValSeg>() == 24,
    "ValSeg as validate.cu lays it out"
);
const _: () = assert!(
    kernels::VALIDATE_SEGMENTS >= 5,
    "one launch checks q or q_scale, k, k_scale, weights and k_slots"
);

// SAFETY: plain old data (u64 and u32 fields, repr(C), no implicit padding) with the
// layout of validate.cu's `ValSegs`, passed by value as a kernel parameter.
unsafe impl cudarc::driver::DeviceRepr for ValSegs {}

/// Bits of a validation key below the segment index (`VAL_INDEX_BITS`).
const VAL_INDEX_BITS: u32 = 56;

/// Segment kinds, as `validate.cu` defines them: E4M3 codes, UE8M0 scales, f32 finite
/// and > 0, f32 finite, i32 >= 0.
const VAL_KINDS: [(&str, u32); 5] = [
    ("VAL_E4M3", 0),
    ("VAL_UE8M0", 1),
    ("VAL_POSITIVE", 2),
    ("VAL_FINITE", 3),
    ("VAL_NONNEG", 4),
];

/// A device input whose values SPEC 8 constrains.
enum Checked<'v, 'a> {
    /// E4M3 codes (`q`, `k`): no `0x7F` / `0xFF`.
    E4m3(&'static str, &'v CudaView<'a, u8>),
    /// UE8M0 scales (`q_scale`, `k_scale`): no 255.
    Ue8m0(&'static str, &'v CudaView<'a, u8>),
    /// Per-key f32 scales `k_scale`: finite and > 0.
    KeyScale(&'v CudaView<'a, f32>),
    /// `weights`: finite.
    Weights(&'v CudaView<'a, f32>),
    /// `k_slots`: >= 0.
    Slots(&'v CudaView<'a, i32>),
}

impl Checked<'_, '_> {
    fn field(&self) -> &'static str {
        match self {
            Checked::E4m3(f, _) | Checked::Ue8m0(f, _) => f,
            Checked::KeyScale(_) => "k_scale",
            Checked::Weights(_) => "weights",
            Checked::Slots(_) => "k_slots",
        }
    }

    /// The kernel's segment: address, length, kind; and the element size in bytes.
    fn segment(&self, s: &CudaStream) -> (ValSeg, u64) {
        let (ptr, len, kind, esize) = match self {
            Checked::E4m3(_, v) => (vptr(v, s), v.len(), VAL_KINDS[0].1, 1),
            Checked::Ue8m0(_, v) => (vptr(v, s), v.len(), VAL_KINDS[1].1, 1),
            Checked::KeyScale(v) => (vptr(v, s), v.len(), VAL_KINDS[2].1, 4),
            Checked::Weights(v) => (vptr(v, s), v.len(), VAL_KINDS[3].1, 4),
            Checked::Slots(v) => (vptr(v, s), v.len(), VAL_KINDS[4].1, 4),
        };
        let seg = ValSeg {
            ptr,
            len: len as u64,
            kind,
            pad: 0,
        };
        (seg, esize)
    }

    /// The error for element `index`, with its value copied back: the one
    /// [`Problem::new`] builds.
    fn error(&self, s: &Arc<CudaStream>, index: usize) -> Result<Error> {
        fn one<T: cudarc::driver::DeviceRepr + Copy>(
            s: &Arc<CudaStream>,
            v: &CudaView<'_, T>,
            index: usize,
        ) -> Result<T> {
            let cell = v
                .try_slice(index..index + 1)
                .ok_or_else(|| backend_err(format!("validation index {index} out of range")))?;
            let host = s
                .clone_dtoh(&cell)
                .map_err(drv("copy offending value back"))?;
            host.first()
                .copied()
                .ok_or_else(|| backend_err("empty copy of the offending value"))
        }
        Ok(match self {
            Checked::E4m3(f, v) => Error::nan_e4m3(f, index, one(s, v, index)?),
            Checked::Ue8m0(f, _) => Error::reserved_scale(f, index),
            Checked::KeyScale(v) => Error::bad_key_scale(index, one(s, v, index)?),
            Checked::Weights(v) => Error::bad_weight(index, one(s, v, index)?),
            Checked::Slots(v) => Error::negative_slot(index, one(s, v, index)?),
        })
    }
}

/// SPEC 8's value checks of `tensors` (in the order their errors take precedence) on
/// the device: one `validate_inputs` launch over every non-empty tensor, one 8-byte copy
/// back (which waits for the stream), and for an offender one more element copy for its
/// value. Empty tensors launch nothing.
fn validate(dev: &Device, tensors: &[Checked<'_, '_>]) -> Result<()> {
    let s = &dev.stream;
    let mut segs = ValSegs::default();
    let mut used: Vec<&Checked> = Vec::with_capacity(tensors.len());
    let mut max_chunks = 0u64;
    for c in tensors {
        let (seg, esize) = c.segment(s);
        if seg.len == 0 {
            continue;
        }
        if seg.ptr % esize != 0 {
            return Err(backend_err(format!(
                "{}: device address {:#x} is not a multiple of its element size {esize}",
                c.field(),
                seg.ptr
            )));
        }
        if seg.len >= 1 << VAL_INDEX_BITS {
            return Err(Error::range(
                c.field(),
                seg.len,
                "fewer than 2^56 elements on the CUDA backend",
            ));
        }
        let slot = segs
            .s
            .get_mut(used.len())
            .ok_or_else(|| backend_err("more tensors to validate than VALIDATE_SEGMENTS"))?;
        *slot = seg;
        used.push(c);
        max_chunks = max_chunks.max((seg.len * esize).div_ceil(16));
    }
    if used.is_empty() {
        return Ok(());
    }
    let f = dev.function(Variant::Validate, "validate_inputs")?;
    let mut first = s
        .clone_htod(&[u64::MAX])
        .map_err(drv("upload validation word"))?;
    // One 16-byte chunk per thread and pass; up to 1024 blocks per tensor (about 8 per
    // SM of an H200), grid-stride beyond.
    let gx = max_chunks
        .div_ceil(kernels::VALIDATE_THREADS as u64)
        .clamp(1, 1024) as u32;
    let mut l = s.launch_builder(&f);
    l.arg(&segs).arg(&mut first);
    // SAFETY: segment y reads elements [0, len) of a live device tensor of at least that
    // length (checked against the batch) whose address is a multiple of its element
    // size; the kernel writes only the one u64 of `first`.
    unsafe {
        l.launch(LaunchConfig {
            grid_dim: (gx, used.len() as u32, 1),
            block_dim: (kernels::VALIDATE_THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        })
    }
    .map_err(drv("launch validate_inputs"))?;
    let key = s
        .clone_dtoh(&first)
        .map_err(drv("copy validation word back"))?;
    s.synchronize().map_err(drv("synchronize"))?;
    let key = key.first().copied().unwrap_or(u64::MAX);
    if key == u64::MAX {
        return Ok(());
    }
    let (seg, index) = (
        (key >> VAL_INDEX_BITS) as usize,
        (key & ((1u64 << VAL_INDEX_BITS) - 1)) as usize,
    );
    let c = used
        .get(seg)
        .ok_or_else(|| backend_err(format!("validation key {key:#x}: no segment {seg}")))?;
    Err(c.error(s, index)?)
}

/// Whether `p`'s class is held bitwise (exact) on this backend.
pub fn is_bitwise(p: &Problem) -> bool {
    p.class() == Class::Exact
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The split top-k's scratch is planned as `SPLIT_SEGMENTS * K` ids: every tile's
    /// rows x segments must stay within it, and long rows of small tiles must split.
    #[test]
    fn split_segments_stay_within_the_planned_scratch() {
        for rows in 0..400 {
            for max_n in [0usize, 1, 100, 4095, 4096, 65536, 1 << 20] {
                for topk in [1usize, 7, 512, 2048, 65536] {
                    let s = split_segments(rows, max_n, topk);
                    assert!(s >= 1);
                    if s > 1 {
                        assert!(rows * s <= SPLIT_SEGMENTS, "rows {rows} x {s}");
                        assert!(max_n / s >= 8 * topk, "segments of >= 8 K keys");
                    }
                }
            }
        }
        assert!(split_segments(64, 1 << 20, 512) > 1);
        assert_eq!(split_segments(SPLIT_ROWS, 1 << 20, 512), 1);
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
        // TK_SHORT=0 (short = 0): never.
        assert_eq!(short_row_cap([k + 1].into_iter(), k, 0, 0), 0);
    }

    #[test]
    fn footprint_counts_metadata_and_split_scratch() {
        let fp = footprint(1000, 512);
        assert_eq!(fp.align, ROW_ALIGN);
        assert_eq!(
            fp.worker_bytes,
            1000 * META_BYTES_PER_ROW + SPLIT_SEGMENTS * 512 * 4 + PATHS_BYTES
        );
        assert_eq!(fp.row_bytes(17), 32 * 4);
    }

    /// The host's mirror of `validate.cu`'s constants and its by-value segment table.
    #[test]
    fn validation_constants_match_the_kernel() {
        let src = Variant::Validate.source();
        for (name, v) in VAL_KINDS {
            assert!(
                src.contains(&format!("#define {name} {v}u ")),
                "{name} = {v}"
            );
        }
        assert!(src.contains(&format!("#define VAL_INDEX_BITS {VAL_INDEX_BITS}\n")));
        assert!(src.contains(&format!(
            "#define VAL_SEGS {}\n",
            kernels::VALIDATE_SEGMENTS
        )));
        assert!(src.contains(&format!(
            "#define VAL_THREADS {}\n",
            kernels::VALIDATE_THREADS
        )));
        assert_eq!(
            std::mem::size_of::<ValSegs>(),
            24 * kernels::VALIDATE_SEGMENTS
        );
    }

    #[test]
    fn every_variant_has_its_defines() {
        let all = Variant::all();
        assert_eq!(all.len(), 2 + 4 * 3 * 4);
        assert!(all.contains(&Variant::Validate));
        for v in all {
            let src = v.source();
            if let Variant::Logits { heads, groups, .. } = v {
                assert!(src.contains(&format!("#define DSA_H {heads}\n")));
                assert!(src.contains(&format!("#define DSA_G {groups}\n")));
            }
            assert!(
                src.contains("rank_key"),
                "{}: common.cuh prepended",
                v.name()
            );
        }
    }

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
            // The exact class at H = 32, D >= 64 on wgmma, its keys in registers.
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
