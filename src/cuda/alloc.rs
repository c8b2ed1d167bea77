//! Every device allocation of the backend goes through one function,
//! [`Device::allocate`], which counts its bytes ([`Device::allocated_bytes`], and per
//! thread [`allocated_on_this_thread`], from which a run's counted transient figure is
//! taken). A unit test checks the sources of `src/cuda/` for allocations anywhere else.
//! [`Device::driver_used_bytes`] reads the driver's own figure (`cuMemGetInfo`).
//!
//! A run whose caller provides the memory ([`super::Engine::prepare_device`]) takes its
//! buffers from [`Device::buffer`] in a [`Space`] instead: regions carved out of the
//! caller's workspace (which a framework took from its own allocator), or only
//! measured, to size that workspace. Nothing is then allocated at all.

use std::cell::Cell;
use std::sync::atomic::Ordering;

use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, DriverError, ValidAsZeroBits};

use super::device::{backend_err, drv, ptr, Device};
use crate::error::{Error, Result};

thread_local! {
    /// Bytes [`Device::allocate`] has allocated on this thread, on any device.
    static THREAD_BYTES: Cell<u64> = const { Cell::new(0) };
}

/// Device bytes [`Device::allocate`] has allocated from this thread so far (never
/// decreasing): the difference across a stretch of code is what that code allocated,
/// whatever other threads allocate on the same device meanwhile.
pub(super) fn allocated_on_this_thread() -> u64 {
    THREAD_BYTES.with(|c| c.get())
}

/// What a new device buffer holds.
#[derive(Debug, Clone, Copy)]
pub(super) enum Fill<'h, T> {
    /// This many elements, all zero bits.
    Zeros(usize),
    /// A copy of these host values.
    Host(&'h [T]),
    /// One element, not initialised, that no kernel reads: it stands for an empty input
    /// (a zero-length allocation is not allowed).
    OneUnread,
    /// No element (cudarc's null slice).
    Empty,
}

/// Alignment of every region carved out of a caller's workspace, in bytes (and of the
/// workspace itself).
pub const WORKSPACE_ALIGN: usize = 256;

/// Where a run's device buffers come from.
#[derive(Debug)]
pub(super) enum Space {
    /// [`Device::allocate`]: the backend's own buffers, freed with the run.
    Own,
    /// Consecutive regions of a caller's workspace of `len` bytes at device address
    /// `base`, each [`WORKSPACE_ALIGN`]-aligned; `at` bytes are taken.
    Carve { base: u64, len: usize, at: usize },
    /// Nothing allocated, written or launched: the regions' extent only (`at` bytes so
    /// far), to size a workspace.
    Measure { at: usize },
}

impl Space {
    /// The bytes of workspace the regions taken so far span (0 for [`Space::Own`]).
    pub(super) fn used(&self) -> usize {
        match self {
            Space::Own => 0,
            Space::Carve { at, .. } | Space::Measure { at } => *at,
        }
    }

    /// The same space with nothing taken yet: the same workspace from its start, or a
    /// new measure (for scratch that is done with before the next is taken).
    pub(super) fn fresh(&self) -> Space {
        match self {
            Space::Own => Space::Own,
            Space::Carve { base, len, .. } => Space::Carve {
                base: *base,
                len: *len,
                at: 0,
            },
            Space::Measure { .. } => Space::Measure { at: 0 },
        }
    }

    /// Whether this space only measures.
    pub(super) fn measuring(&self) -> bool {
        matches!(self, Space::Measure { .. })
    }

    /// The offset of the next region of `bytes` bytes, taken; an error naming the
    /// workspace when a carved one is too small.
    fn take(&mut self, bytes: usize) -> Result<usize> {
        let (at, len) = match self {
            Space::Own => return Err(backend_err("Space::take on the backend's own space")),
            Space::Carve { at, len, .. } => (at, Some(*len)),
            Space::Measure { at } => (at, None),
        };
        let start = *at;
        let end = start
            .checked_add(bytes)
            .and_then(|e| e.checked_next_multiple_of(WORKSPACE_ALIGN))
            .ok_or_else(|| Error::range("workspace", "past usize", "fewer bytes"))?;
        if let Some(len) = len {
            if start + bytes > len {
                return Err(Error::range(
                    "workspace",
                    format!("{len} bytes"),
                    "at least the bytes DeviceRun::workspace_bytes gives",
                ));
            }
        }
        *at = end;
        Ok(start)
    }
}

/// A device buffer of a run: its own, or a region of a caller's workspace (or of a
/// measured one: address 0).
#[derive(Debug)]
pub(super) enum Buf<T> {
    /// Allocated by [`Device::allocate`].
    Own(CudaSlice<T>),
    /// `len` elements at device address `addr`, owned by the caller.
    At { addr: u64, len: usize },
}

impl<T> Buf<T> {
    /// Its device address.
    pub(super) fn addr(&self, s: &CudaStream) -> u64 {
        match self {
            Buf::Own(b) => ptr(b, s),
            Buf::At { addr, .. } => *addr,
        }
    }

    /// The backend's own buffer, if it is one.
    pub(super) fn owned(&self) -> Option<&CudaSlice<T>> {
        match self {
            Buf::Own(b) => Some(b),
            Buf::At { .. } => None,
        }
    }

    /// The backend's own buffer, if it is one, taken.
    pub(super) fn into_owned(self) -> Option<CudaSlice<T>> {
        match self {
            Buf::Own(b) => Some(b),
            Buf::At { .. } => None,
        }
    }

    /// The backend's own buffer, mutably, if it is one.
    pub(super) fn owned_mut(&mut self) -> Option<&mut CudaSlice<T>> {
        match self {
            Buf::Own(b) => Some(b),
            Buf::At { .. } => None,
        }
    }
}

impl Device {
    /// A buffer holding `fill` in `space`: [`Device::allocate`]'s for [`Space::Own`]; a
    /// region of the workspace for [`Space::Carve`], filled on the device's stream (a
    /// host copy's source may be dropped on return: the driver stages pageable memory
    /// before the call returns); for [`Space::Measure`] a region at address 0, nothing
    /// written. `what` names it in errors.
    pub(super) fn buffer<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        space: &mut Space,
        fill: Fill<'_, T>,
        what: &str,
    ) -> Result<Buf<T>> {
        if let Space::Own = space {
            return self.allocate(fill).map(Buf::Own).map_err(drv(what));
        }
        let len = match fill {
            Fill::Zeros(len) => len,
            Fill::Host(host) => host.len(),
            Fill::OneUnread => 1,
            Fill::Empty => return Ok(Buf::At { addr: 0, len: 0 }),
        };
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| Error::range(what, len, "fewer elements (bytes past usize)"))?;
        let off = space.take(bytes)?;
        let Space::Carve { base, .. } = *space else {
            return Ok(Buf::At { addr: 0, len });
        };
        let addr = base + off as u64;
        let cu = self.stream.cu_stream();
        match fill {
            // SAFETY: [addr, addr + bytes) is a region of the caller's live workspace
            // (Space::take checked it against the workspace's length), written in stream
            // order on the device's stream.
            Fill::Zeros(_) if bytes > 0 => {
                unsafe { cudarc::driver::result::memset_d8_async(addr, 0, bytes, cu) }
                    .map_err(drv(what))?
            }
            // SAFETY: as above; `host` holds exactly `bytes` bytes.
            Fill::Host(host) if bytes > 0 => {
                unsafe { cudarc::driver::result::memcpy_htod_async(addr, host, cu) }
                    .map_err(drv(what))?
            }
            _ => {}
        }
        Ok(Buf::At { addr, len })
    }

    /// Zero `bytes` bytes at device address `addr` (a caller's buffer) on the device's
    /// stream; `what` names it in errors.
    pub(super) fn zero(&self, addr: u64, bytes: usize, what: &str) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: the caller's live buffer of at least `bytes` bytes at `addr` (its length
        // checked against the run's shapes), written in stream order.
        unsafe { cudarc::driver::result::memset_d8_async(addr, 0, bytes, self.stream.cu_stream()) }
            .map_err(drv(what))
    }

    /// `buf`'s elements on the host, after everything queued on the device's stream
    /// before (one wait for the stream).
    pub(super) fn read_back<T: DeviceRepr + ValidAsZeroBits + Default + Clone>(
        &self,
        buf: &Buf<T>,
        what: &str,
    ) -> Result<Vec<T>> {
        let s = &self.stream;
        let host = match buf {
            Buf::Own(b) => s.clone_dtoh(b).map_err(drv(what))?,
            Buf::At { addr, len } => {
                let mut host = vec![T::default(); *len];
                if *len > 0 {
                    // SAFETY: `len` elements at `addr` of the caller's live workspace,
                    // read in stream order into a host buffer of that length.
                    unsafe {
                        cudarc::driver::result::memcpy_dtoh_async(&mut host, *addr, s.cu_stream())
                    }
                    .map_err(drv(what))?;
                }
                host
            }
        };
        s.synchronize().map_err(drv("synchronize"))?;
        Ok(host)
    }

    /// A new buffer on the device's stream holding `fill`, its bytes added to
    /// [`Device::allocated_bytes`]: the backend's one device allocation.
    pub(super) fn allocate<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        fill: Fill<'_, T>,
    ) -> Result<CudaSlice<T>, DriverError> {
        let s = &self.stream;
        let (buf, len) = match fill {
            Fill::Zeros(len) => (s.alloc_zeros::<T>(len)?, len),
            Fill::Host(host) => (s.clone_htod(host)?, host.len()),
            // SAFETY: an uninitialised one-element buffer that no kernel reads (its length
            // stands for an empty input).
            Fill::OneUnread => (unsafe { s.alloc::<T>(1) }?, 1),
            Fill::Empty => (s.null::<T>()?, 0),
        };
        let bytes = len.saturating_mul(std::mem::size_of::<T>()) as u64;
        self.allocated.fetch_add(bytes, Ordering::Relaxed);
        THREAD_BYTES.with(|c| c.set(c.get().saturating_add(bytes)));
        Ok(buf)
    }

    /// Device bytes the backend has allocated on this device so far: every buffer
    /// (uploaded inputs, per-row metadata, transient buffers, outputs, path counters,
    /// the validation word, the codec test's tables). Buffers freed are not subtracted.
    pub fn allocated_bytes(&self) -> u64 {
        self.allocated.load(Ordering::Relaxed)
    }

    /// Device memory in use as the driver reports it (`cuMemGetInfo`: total minus free),
    /// by every process and context on the GPU: the driver-level figure beside the
    /// counted one.
    pub fn driver_used_bytes(&self) -> Result<usize, DriverError> {
        let (free, total) = self.ctx.mem_get_info()?;
        Ok(total.saturating_sub(free))
    }
}

#[cfg(test)]
mod tests {
    /// The sources of `src/cuda/`, by file name.
    const SOURCES: [(&str, &str); 14] = [
        ("alloc.rs", include_str!("alloc.rs")),
        ("backend.rs", include_str!("backend.rs")),
        ("bench.rs", include_str!("bench.rs")),
        ("decode.rs", include_str!("decode.rs")),
        ("device.rs", include_str!("device.rs")),
        ("engine.rs", include_str!("engine.rs")),
        ("geometry.rs", include_str!("geometry.rs")),
        ("kernels.rs", include_str!("kernels.rs")),
        ("launch.rs", include_str!("launch.rs")),
        ("mod.rs", include_str!("mod.rs")),
        ("paths.rs", include_str!("paths.rs")),
        ("run.rs", include_str!("run.rs")),
        ("tolerance.rs", include_str!("tolerance.rs")),
        ("validate.rs", include_str!("validate.rs")),
    ];

    /// The cudarc calls that allocate device memory.
    const ALLOCATING: [&str; 7] = [
        "alloc_zeros",
        ".alloc(",
        ".alloc::<",
        "clone_htod",
        "memcpy_stod",
        ".null(",
        ".null::<",
    ];

    /// The lines of `src` that call an allocating cudarc function.
    fn allocating_lines(src: &str) -> Vec<String> {
        src.lines()
            .filter(|l| !l.trim_start().starts_with("//"))
            .filter(|l| ALLOCATING.iter().any(|a| l.contains(a)))
            .map(|l| l.trim().to_string())
            .collect()
    }

    /// Every device allocation in `src/cuda/` is `Device::allocate`'s: no other line of the
    /// sources calls cudarc's allocating functions, and `Device::allocate` calls each of its
    /// four once.
    #[test]
    fn every_device_allocation_goes_through_device_allocate() {
        for (name, src) in SOURCES {
            let src = if name == "alloc.rs" {
                // Outside the tests (whose strings name the calls), only the body of
                // Device::allocate may allocate.
                let code = &src[..src.find("#[cfg(test)]").unwrap()];
                let start = code.find("    pub(super) fn allocate<").unwrap();
                let end = start + code[start..].find("\n    }\n").unwrap();
                assert_eq!(
                    allocating_lines(&code[start..end]),
                    [
                        "Fill::Zeros(len) => (s.alloc_zeros::<T>(len)?, len),",
                        "Fill::Host(host) => (s.clone_htod(host)?, host.len()),",
                        "Fill::OneUnread => (unsafe { s.alloc::<T>(1) }?, 1),",
                        "Fill::Empty => (s.null::<T>()?, 0),",
                    ]
                );
                format!("{}{}", &code[..start], &code[end..])
            } else {
                src.to_string()
            };
            let found = allocating_lines(&src);
            assert!(
                found.is_empty(),
                "{name} allocates outside Device::allocate: {found:?}"
            );
        }
    }

    /// The list above holds every source file of `src/cuda/`.
    #[test]
    fn the_allocation_check_reads_every_source_file() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/cuda");
        let mut files: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.ends_with(".rs"))
            .collect();
        files.sort();
        let listed: Vec<&str> = SOURCES.iter().map(|(n, _)| *n).collect();
        assert_eq!(files, listed);
        assert!(
            std::fs::read_dir(&dir)
                .unwrap()
                .all(|e| !e.unwrap().file_type().unwrap().is_dir()),
            "src/cuda/ has no subfolders the check would miss"
        );
    }
}
