//! SPEC 8's value checks of device inputs (the engine API): one `validate_inputs`
//! launch (`kernels/validate.cu`) over every tensor, and the error [`Problem::new`]
//! gives for the same host arrays for the first offender.
//!
//! [`Problem::new`]: crate::problem::Problem::new

use std::sync::Arc;

use cudarc::driver::{CudaStream, CudaView, LaunchConfig, PushKernelArg};

use super::alloc::{Fill, Space};
use super::device::{backend_err, drv, vptr, Device};
use super::kernels::{self, Variant};
use crate::error::{Error, Result};

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
pub(super) enum Checked<'v, 'a> {
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
    /// [`Problem::new`](crate::problem::Problem::new) builds.
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
/// value. Empty tensors launch nothing. Its 8-byte verdict word is taken from `space`
/// (under [`Space::Measure`] nothing runs); returns the workspace bytes it took.
pub(super) fn validate(
    dev: &Device,
    mut space: Space,
    tensors: &[Checked<'_, '_>],
) -> Result<usize> {
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
        return Ok(0);
    }
    let first = dev.buffer(
        &mut space,
        Fill::Host(&[u64::MAX]),
        "upload validation word",
    )?;
    if space.measuring() {
        return Ok(space.used());
    }
    let f = dev.function(Variant::Validate, "validate_inputs")?;
    let first_p = first.addr(s);
    // One 16-byte chunk per thread and pass; up to 1024 blocks per tensor (about 8 per
    // SM of an H200), grid-stride beyond.
    let gx = max_chunks
        .div_ceil(kernels::VALIDATE_THREADS as u64)
        .clamp(1, 1024) as u32;
    let mut l = s.launch_builder(&f);
    l.arg(&segs).arg(&first_p);
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
    let key = dev.read_back(&first, "copy validation word back")?;
    let key = key.first().copied().unwrap_or(u64::MAX);
    if key == u64::MAX {
        return Ok(space.used());
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

/// Paged keys on the device as [`validate_paged`] checks them.
pub(super) struct PagedView<'v, 'a> {
    /// Element format.
    pub(super) format: crate::problem::Format,
    /// `D`.
    pub(super) dim: usize,
    /// The pool.
    pub(super) kv_cache: &'v CudaView<'a, u8>,
    /// `i32 [B, cols]`.
    pub(super) page_table: &'v CudaView<'a, i32>,
    /// Page-table entries per request.
    pub(super) cols: usize,
    /// `log2(P)`.
    pub(super) page_log2: u32,
    /// Pages in the pool.
    pub(super) num_pages: usize,
}

/// SPEC 8's value checks of paged keys (SPEC 10) on the device, what
/// [`crate::paged::PagedKeys::validate`] checks after its shapes, with its errors: every
/// used page-table entry of `batch`'s requests a page of the pool
/// (`validate_page_ids`), then every slot some request reads (`validate_slots`: codes
/// not NaN, scales finite and > 0 or not UE8M0 255). Unused entries and pages, and the
/// slots of a page past its readers' keys, are not read. One copy back of the two
/// verdict words (which waits for the stream), one more for an offending value. Its
/// buffers are taken from `space` (under [`Space::Measure`] nothing runs); returns the
/// workspace bytes they took.
pub(super) fn validate_paged(
    dev: &Device,
    mut space: Space,
    batch: &crate::batch::Batch,
    v: &PagedView<'_, '_>,
) -> Result<usize> {
    let s = &dev.stream;
    let reqs = batch.requests();
    if reqs.is_empty() || v.cols == 0 {
        return Ok(0);
    }
    let keys: Vec<u32> = reqs.iter().map(|r| r.keys as u32).collect();
    let req_keys = dev.buffer(&mut space, Fill::Host(&keys), "upload request keys")?;
    let used = dev.buffer::<u32>(
        &mut space,
        if v.num_pages > 0 {
            Fill::Zeros(v.num_pages)
        } else {
            Fill::OneUnread
        },
        "alloc used slots",
    )?;
    let first = dev.buffer(
        &mut space,
        Fill::Host(&[u64::MAX, u64::MAX]),
        "upload validation words",
    )?;
    if space.measuring() {
        return Ok(space.used());
    }
    let (req_keys, used, first_b, first) = (req_keys.addr(s), used.addr(s), first.addr(s), first);
    let threads = kernels::VALIDATE_THREADS as u64;
    let grid = |n: u64| n.div_ceil(threads).clamp(1, 1024) as u32;
    let cfg = |gx: u32| LaunchConfig {
        grid_dim: (gx, 1, 1),
        block_dim: (kernels::VALIDATE_THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let (cols, requests, num_pages) = (v.cols as u32, reqs.len() as u32, v.num_pages as u32);
    let pt = vptr(v.page_table, s);
    let pool = vptr(v.kv_cache, s);
    let f = dev.function(Variant::Validate, "validate_page_ids")?;
    let mut l = s.launch_builder(&f);
    l.arg(&pt)
        .arg(&cols)
        .arg(&requests)
        .arg(&req_keys)
        .arg(&v.page_log2)
        .arg(&num_pages)
        .arg(&used)
        .arg(&first_b);
    // SAFETY: reads the B x cols page table (checked length) and B request key counts;
    // writes `used` only at ids in [0, num_pages) and the two words of `first`.
    unsafe { l.launch(cfg(grid(reqs.len() as u64 * v.cols as u64))) }
        .map_err(drv("launch validate_page_ids"))?;
    if v.num_pages > 0 {
        let e2m1 = u32::from(v.format == crate::problem::Format::E2m1);
        let dim = v.dim as u32;
        let f = dev.function(Variant::Validate, "validate_slots")?;
        let mut l = s.launch_builder(&f);
        l.arg(&pool)
            .arg(&v.page_log2)
            .arg(&num_pages)
            .arg(&e2m1)
            .arg(&dim)
            .arg(&used)
            .arg(&first_b);
        // SAFETY: reads slots t < used[page] of pages of the pool (checked length, a
        // whole number of pages, 16-byte aligned pages) and writes the second word.
        unsafe { l.launch(cfg(grid((v.num_pages as u64) << v.page_log2))) }
            .map_err(drv("launch validate_slots"))?;
    }
    let words = dev.read_back(&first, "copy validation words back")?;
    let one = |view: CudaView<'_, u8>, what: &str| -> Result<Vec<u8>> {
        s.clone_dtoh(&view).map_err(drv(what))
    };
    if words[0] != u64::MAX {
        let x = words[0] as usize;
        let cell = v
            .page_table
            .try_slice(x..x + 1)
            .ok_or_else(|| backend_err(format!("page-table entry {x} out of range")))?;
        let id = s
            .clone_dtoh(&cell)
            .map_err(drv("copy offending page id back"))?[0];
        return Err(Error::range(
            format!("page_table[{}, {}]", x / v.cols, x % v.cols),
            id,
            "a page id in [0, num_pages) for every used entry",
        ));
    }
    if words[1] == u64::MAX {
        return Ok(space.used());
    }
    let g = v.dim / 32;
    let p = 1usize << v.page_log2;
    let w = match v.format {
        crate::problem::Format::E4m3 => v.dim,
        crate::problem::Format::E2m1 => g,
    };
    let key = words[1] as usize;
    let (slot, pos) = (key / (w + 1), key % (w + 1));
    let (page, t) = (slot / p, slot % p);
    let field = |what: &str| format!("kv_cache[page {page}, slot {t}].{what}");
    let bpt = crate::paged::bytes_per_token(v.format, v.dim);
    let base = page * p * bpt;
    let bytes = |at: usize, n: usize| -> Result<Vec<u8>> {
        let view = v
            .kv_cache
            .try_slice(at..at + n)
            .ok_or_else(|| backend_err(format!("kv_cache byte {at} out of range")))?;
        one(view, "copy offending value back")
    };
    Err(match v.format {
        crate::problem::Format::E4m3 if pos < v.dim => {
            let b = bytes(base + t * v.dim + pos, 1)?;
            Error::nan_e4m3(&field("k"), pos, b[0])
        }
        crate::problem::Format::E4m3 => {
            let b = bytes(base + p * v.dim + 4 * t, 4)?;
            Error::BadFloat {
                field: field("scale"),
                index: 0,
                value: f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
                expected: "finite and > 0",
            }
        }
        crate::problem::Format::E2m1 => Error::reserved_scale(&field("k_scale"), pos),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The host's mirror of `validate.cu`'s constants and its by-value segment table.
    #[test]
    fn validation_constants_match_the_kernel() {
        let src = Variant::Validate.source(kernels::Hooks::default());
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
}
