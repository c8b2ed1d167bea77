//! The device: its context and stream, its test hooks, the process's compiled modules
//! (compiled by NVRTC once per variant, hooks and process, loaded once per device), and
//! the backend's error constructors.

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, CudaView, DevicePtr,
    LaunchConfig, PushKernelArg,
};

use super::alloc::Fill;
use super::kernels::{self, Hooks, Variant};
use crate::error::{Error, Result};

pub(super) fn backend_err(problem: impl Into<String>) -> Error {
    Error::Backend {
        backend: "cuda",
        problem: problem.into(),
    }
}

pub(super) fn drv(what: &str) -> impl FnOnce(cudarc::driver::DriverError) -> Error + '_ {
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

/// A CUDA device: its context, a stream, its test hooks ([`Hooks`]; production: none),
/// and the compiled modules of this process.
#[derive(Debug)]
pub struct Device {
    pub(super) ctx: Arc<CudaContext>,
    pub(super) stream: Arc<CudaStream>,
    /// Streaming multiprocessors of the GPU (the launch geometry sizes grids by them).
    sms: usize,
    /// Device bytes allocated through [`Device::allocate`].
    pub(super) allocated: AtomicU64,
    /// The test hooks every module of this device is compiled and launched under.
    hooks: Hooks,
    /// The modules loaded into this context, shared by the devices of
    /// [`Device::on_stream`].
    modules: Arc<Modules>,
}

/// The modules loaded into a context, by variant.
type Modules = Mutex<Vec<(Variant, Arc<CudaModule>)>>;

impl Device {
    /// Open device `ordinal` (an sm_90 GPU) with a new stream.
    pub fn new(ordinal: usize) -> Result<Arc<Device>> {
        Device::open(ordinal, Hooks::default())
    }

    /// Device 0 with a new stream and its own module cache, its kernels compiled and
    /// chosen under `hooks` (the tests' forced fallbacks).
    pub fn with_hooks(hooks: Hooks) -> Result<Arc<Device>> {
        Device::open(0, hooks)
    }

    fn open(ordinal: usize, hooks: Hooks) -> Result<Arc<Device>> {
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
        Device::with_stream_and_hooks(stream, hooks)
    }

    /// Use a caller's stream (and its context): the engine API.
    pub fn with_stream(stream: Arc<CudaStream>) -> Result<Arc<Device>> {
        Device::with_stream_and_hooks(stream, Hooks::default())
    }

    /// [`Device::with_stream`] under test hooks `hooks`.
    pub fn with_stream_and_hooks(stream: Arc<CudaStream>, hooks: Hooks) -> Result<Arc<Device>> {
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
        let sms = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(drv("multiprocessor count"))?;
        if sms < 1 {
            return Err(backend_err(format!(
                "GPU {} reports {sms} multiprocessors",
                ctx.name().unwrap_or_default()
            )));
        }
        Ok(Arc::new(Device {
            ctx,
            stream,
            sms: sms as usize,
            allocated: AtomicU64::new(0),
            hooks,
            modules: Arc::new(Mutex::new(Vec::new())),
        }))
    }

    /// This device on another stream of its context (a framework's current stream,
    /// which changes from call to call, e.g. to a CUDA graph's capture stream): the same
    /// hooks and the same loaded modules, so that nothing is compiled or loaded again.
    /// Its allocation count starts at 0.
    pub fn on_stream(&self, stream: Arc<CudaStream>) -> Result<Arc<Device>> {
        if stream.context().cu_ctx() != self.ctx.cu_ctx() {
            return Err(backend_err(
                "Device::on_stream: the stream belongs to another CUDA context",
            ));
        }
        Ok(Arc::new(Device {
            ctx: stream.context().clone(),
            stream,
            sms: self.sms,
            allocated: AtomicU64::new(0),
            hooks: self.hooks,
            modules: self.modules.clone(),
        }))
    }

    /// The default device 0, opened once per process: production ([`Hooks::default()`]),
    /// or with the `tuning` feature the hooks `$DSA_CUDA_HOOKS` names (comma-separated
    /// [`Hooks`] field names: an experiment's forced fallbacks, e.g. the benchmark's A/B
    /// runs; an unknown name is an error).
    pub fn shared() -> Result<Arc<Device>> {
        static DEV: Mutex<Option<Arc<Device>>> = Mutex::new(None);
        let mut g = DEV
            .lock()
            .map_err(|_| backend_err("device lock poisoned"))?;
        if let Some(d) = g.as_ref() {
            return Ok(d.clone());
        }
        #[cfg(feature = "tuning")]
        let hooks = Hooks::parse(&std::env::var("DSA_CUDA_HOOKS").unwrap_or_default())?;
        #[cfg(not(feature = "tuning"))]
        let hooks = Hooks::default();
        let d = Device::open(0, hooks)?;
        *g = Some(d.clone());
        Ok(d)
    }

    /// The test hooks this device's kernels are compiled and chosen under.
    pub fn hooks(&self) -> Hooks {
        self.hooks
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

    /// Streaming multiprocessors of the GPU (`CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT`:
    /// 132 on an H200 or H100 SXM, 114 on an H100 PCIe).
    pub fn sm_count(&self) -> usize {
        self.sms
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
        // Compile outside the lock; a racing thread may compile the same variant. One
        // compile per module text and process: devices whose hooks change no kernel text
        // (host-side choices such as `no_wide_topk` or `no_cluster_topk`) share the PTX.
        static NVRTC_CACHE: Mutex<Vec<((Variant, String), String)>> = Mutex::new(Vec::new());
        let key = (v, v.source(self.hooks));
        let cached = NVRTC_CACHE
            .lock()
            .ok()
            .and_then(|g| g.iter().find(|(k, _)| *k == key).map(|(_, p)| p.clone()));
        let src = match cached {
            Some(s) => s,
            None => {
                let s = kernels::compile(v, self.hooks)?.to_src();
                if let Ok(mut g) = NVRTC_CACHE.lock() {
                    g.push((key, s.clone()));
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
        let mut a = self
            .allocate::<u32>(Fill::Zeros(256))
            .map_err(drv("alloc"))?;
        let mut b = self
            .allocate::<u32>(Fill::Zeros(16))
            .map_err(drv("alloc"))?;
        let mut c = self
            .allocate::<u32>(Fill::Zeros(16))
            .map_err(drv("alloc"))?;
        let mut d = self
            .allocate::<u32>(Fill::Zeros(256))
            .map_err(drv("alloc"))?;
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

pub(super) fn ptr<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    let (p, _g) = s.device_ptr(stream);
    p
}

pub(super) fn vptr<T>(s: &CudaView<'_, T>, stream: &CudaStream) -> u64 {
    let (p, _g) = s.device_ptr(stream);
    p
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::kernels::Precision;

    #[test]
    fn every_variant_has_its_defines() {
        let all = Variant::all();
        // Flat and paged x 4 head counts x 3 dims x 4 format pairs, and the fast
        // precision's E4M3 x E4M3 at H = 64 (3 dims, flat and paged).
        assert_eq!(all.len(), 2 + 2 * 4 * 3 * 4 + 2 * 3);
        assert!(all.contains(&Variant::Validate));
        for v in all {
            let src = v.source(Hooks::default());
            if let Variant::Logits {
                heads,
                groups,
                precision,
                ..
            } = v
            {
                assert!(src.contains(&format!("#define DSA_H {heads}\n")));
                assert!(src.contains(&format!("#define DSA_G {groups}\n")));
                // The fast precision's module is the fp8 wgmma kernel's.
                let fast = src.contains(") mqa_logits_w8(\n");
                assert_eq!(fast, precision == Precision::Fast, "{}", v.name());
            }
            assert!(
                src.contains("rank_key"),
                "{}: common.cuh prepended",
                v.name()
            );
        }
    }
}
