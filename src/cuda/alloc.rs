//! Every device allocation of the backend goes through one function,
//! [`Device::allocate`], which counts its bytes ([`Device::allocated_bytes`], and per
//! thread [`allocated_on_this_thread`], from which a run's counted transient figure is
//! taken). A unit test checks the sources of `src/cuda/` for allocations anywhere else.
//! [`Device::driver_used_bytes`] reads the driver's own figure (`cuMemGetInfo`).

use std::cell::Cell;
use std::sync::atomic::Ordering;

use cudarc::driver::{CudaSlice, DeviceRepr, DriverError, ValidAsZeroBits};

use super::device::Device;

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

impl Device {
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
