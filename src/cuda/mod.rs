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
//! [`logit_bound`]). The opt-in fast mode ([`Precision::Fast`]) runs E4M3 x E4M3 at
//! `H = 64` on fp8 `wgmma` with chained steps, DeepGEMM's arithmetic, and is held to
//! SPEC 4's fast-mode bound instead ([`fast_logit_bound`]). Given the same scores,
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
//!
//! One file per job:
//!
//! - `backend.rs`: [`CudaBackend`], the driver's backend for host inputs, and [`run_cuda`];
//! - `engine.rs`: the device-input [`Engine`] ([`DeviceInputs`] in, [`DeviceOutput`] out, or
//!   the caller's buffers and workspace through [`DeviceRun`]);
//! - `validate.rs`: the engine inputs' value checks on the device;
//! - `run.rs`: one run's device buffers and its per-tile steps;
//! - `launch.rs`: one launcher per kernel family, its parameters a typed struct;
//! - `geometry.rs`: tile geometry on the host (footprint, row groups, split top-k, short rows);
//! - `device.rs`: the [`Device`], its stream, test hooks ([`Hooks`]) and module cache;
//! - `paths.rs`: the path counters [`TopkPaths`] and [`FoldCounts`];
//! - `tolerance.rs`: the tolerance class's bounds ([`logit_bound`]);
//! - `kernels.rs`: the kernel sources, variants and NVRTC; `bench.rs`: the benchmark workloads.
//!
//! [`Backend`]: crate::indexer::Backend
//! [`Backend::end`]: crate::indexer::Backend::end
//! [`Problem::new`]: crate::problem::Problem::new
//! [`Error::Backend`]: crate::error::Error::Backend

mod alloc;
mod backend;
pub mod bench;
mod decode;
mod device;
mod engine;
mod geometry;
pub mod kernels;
mod launch;
mod paths;
mod run;
mod tolerance;
mod validate;

pub use alloc::WORKSPACE_ALIGN;
pub use backend::{reads_pages, run_cuda, CudaBackend};
pub use decode::{
    decode_workspace_bytes, decode_workspace_terms, DecodeInputs, DecodeShape, DecodeStep,
};
use device::{backend_err, drv};
pub use device::{libraries_present, DecodedCodes, Device};
pub use engine::{
    DeviceInputs, DeviceKeys, DeviceOutput, DeviceQueries, DeviceRun, DeviceRunInfo, Engine,
    INPUT_ALIGN,
};
pub use geometry::{row_groups, tile_logits_kernel, MAX_TOPK, ROW_ALIGN};
pub use kernels::{Hooks, Precision, SelectStream, Variant};
pub use paths::{FoldCounts, TopkPaths};
pub use tolerance::{
    e4m3_align_exp, fast_logit_bound, fp8_chain_error, fp8_wgmma_step, is_bitwise, logit_bound,
    on_fp8_accumulator, tolerance_abs_term, tolerance_bound, F32_SUBNORMAL_ULP, FP8_WGMMA_BITS,
    TOLERANCE_LOG2,
};
