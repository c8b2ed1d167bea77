//! The CUDA backend (feature `cuda`): kernels compiled at run time by NVRTC for `sm_90a`.
pub mod kernels;
