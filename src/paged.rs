//! Paged keys (SPEC 10): the engines' KV-cache layout, pages of `P` tokens addressed
//! through a page table per request.
//!
//! [`PagedKeys`] is a view of the pool and the table; [`crate::problem::Problem::new`]
//! validates it against the batch ([`PagedKeys::validate`]), after which every path
//! reads keys through [`PagedKeys::slot`] and the per-slot accessors. [`FlatKeys`] is
//! the same problem with its keys laid out flat (the tests' cross-check, and the
//! paths that take flat keys only).

use ndarray::{Array1, Array2, ArrayView1, ArrayView2};

use crate::batch::Batch;
use crate::error::{mul, Error, Result};
use crate::formats::e4m3;
use crate::problem::Format;

/// Largest page size (SPEC 10).
pub const MAX_PAGE_SIZE: usize = 256;

/// Keys in a page pool (SPEC 10).
#[derive(Debug, Clone, Copy)]
pub struct PagedKeys<'a> {
    /// Element format of the keys.
    pub format: Format,
    /// The pool, `u8 [num_pages, P * bytes_per_token]`, row-major.
    pub kv_cache: ArrayView2<'a, u8>,
    /// `i32 [B, max_pages]`: key `j` of request `b` is in page `page_table[b, j / P]`.
    pub page_table: ArrayView2<'a, i32>,
    /// `P`: tokens per page, a power of two in 1..=256.
    pub page_size: usize,
}

/// Bytes one token takes in a page: `D + 4` for E4M3 keys, `D/2 + D/32` for E2M1 keys.
pub fn bytes_per_token(format: Format, dim: usize) -> usize {
    match format {
        Format::E4m3 => dim + 4,
        Format::E2m1 => dim / 2 + dim / 32,
    }
}

impl<'a> PagedKeys<'a> {
    /// Pages in the pool.
    pub fn num_pages(&self) -> usize {
        self.kv_cache.nrows()
    }

    /// Bytes of one page (the pool's row width once validated).
    pub fn page_bytes(&self) -> usize {
        self.kv_cache.ncols()
    }

    /// Pool slot of request-local key `j` of request `b`:
    /// `page_table[b, j / P] * P + j % P`. Valid for `j < lc_b` of a validated problem.
    pub fn slot(&self, b: usize, j: usize) -> usize {
        let page = self.page_table[[b, j / self.page_size]] as usize;
        page * self.page_size + j % self.page_size
    }

    fn page(&self, slot: usize) -> (&'a [u8], usize) {
        let page = slot / self.page_size;
        let bytes = self.page_bytes();
        // Validated: row-major, so the whole pool is one slice.
        let all: &'a [u8] = self.kv_cache.to_slice().unwrap_or(&[]);
        (
            &all[page * bytes..(page + 1) * bytes],
            slot % self.page_size,
        )
    }

    /// The key's codes at `slot`: `D` E4M3 bytes or `D/2` packed E2M1 bytes.
    pub fn codes(&self, slot: usize, dim: usize) -> &'a [u8] {
        let (page, t) = self.page(slot);
        let w = match self.format {
            Format::E4m3 => dim,
            Format::E2m1 => dim / 2,
        };
        &page[t * w..(t + 1) * w]
    }

    /// An E4M3 key's f32 scale at `slot`.
    pub fn e4m3_scale(&self, slot: usize, dim: usize) -> f32 {
        let (page, t) = self.page(slot);
        let at = self.page_size * dim + 4 * t;
        f32::from_le_bytes([page[at], page[at + 1], page[at + 2], page[at + 3]])
    }

    /// An E2M1 key's `G` UE8M0 group scales at `slot`.
    pub fn e2m1_scales(&self, slot: usize, dim: usize) -> &'a [u8] {
        let (page, t) = self.page(slot);
        let g = dim / 32;
        let at = self.page_size * dim / 2 + t * g;
        &page[at..at + g]
    }

    /// Pages request `b` uses: `ceil(lc_b / P)`.
    pub fn used_pages(&self, keys: usize) -> usize {
        keys.div_ceil(self.page_size)
    }

    /// SPEC 8 for paged keys: the page size, the pool's width, the table's width for
    /// every request, every used entry's page id, and every value some request reads.
    /// Nothing else is read.
    pub fn validate(&self, batch: &Batch, dim: usize) -> Result<()> {
        let p = self.page_size;
        if !(p.is_power_of_two() && p <= MAX_PAGE_SIZE) {
            return Err(Error::range("page_size", p, "a power of two in 1..=256"));
        }
        let width = mul(p, bytes_per_token(self.format, dim), "kv_cache page bytes")?;
        if self.kv_cache.ncols() != width {
            return Err(Error::shape(
                "kv_cache",
                self.kv_cache.shape(),
                &[self.num_pages(), width],
            ));
        }
        if self.kv_cache.to_slice().is_none() {
            return Err(Error::range(
                "kv_cache",
                "a strided view",
                "a row-major [num_pages, P * bytes_per_token] array",
            ));
        }
        // raw/page are i32: every pool slot must fit.
        let slots = mul(self.num_pages(), p, "kv_cache slots")?;
        if slots > i32::MAX as usize {
            return Err(Error::range(
                "kv_cache slots",
                slots,
                "num_pages * page_size <= 2^31 - 1 (page is i32)",
            ));
        }
        let reqs = batch.requests();
        if self.page_table.nrows() != reqs.len() {
            return Err(Error::shape(
                "page_table",
                self.page_table.shape(),
                &[reqs.len(), self.page_table.ncols()],
            ));
        }
        // Slots read per page: a prefix 0 .. used[page] (the longest reader's).
        let mut used = vec![0usize; self.num_pages()];
        for (b, r) in reqs.iter().enumerate() {
            let need = self.used_pages(r.keys);
            if need > self.page_table.ncols() {
                return Err(Error::range(
                    format!("page_table[{b}]"),
                    format!("{} entries", self.page_table.ncols()),
                    "at least ceil(L_b / page_size) entries for every request",
                ));
            }
            for e in 0..need {
                let id = self.page_table[[b, e]];
                if id < 0 || id as usize >= self.num_pages() {
                    return Err(Error::range(
                        format!("page_table[{b}, {e}]"),
                        id,
                        "a page id in [0, num_pages) for every used entry",
                    ));
                }
                let count = (r.keys - e * p).min(p);
                let u = &mut used[id as usize];
                *u = (*u).max(count);
            }
        }
        for (page, &count) in used.iter().enumerate() {
            for t in 0..count {
                self.check_slot(page, t, dim)?;
            }
        }
        Ok(())
    }

    fn check_slot(&self, page: usize, t: usize, dim: usize) -> Result<()> {
        let slot = page * self.page_size + t;
        let field = |what: &str| format!("kv_cache[page {page}, slot {t}].{what}");
        match self.format {
            Format::E4m3 => {
                let codes = self.codes(slot, dim);
                if let Some(d) = codes.iter().position(|&b| e4m3::is_nan_code(b)) {
                    return Err(Error::nan_e4m3(&field("k"), d, codes[d]));
                }
                let s = self.e4m3_scale(slot, dim);
                if !(s.is_finite() && s > 0.0) {
                    return Err(Error::BadFloat {
                        field: field("scale"),
                        index: 0,
                        value: s,
                        expected: "finite and > 0",
                    });
                }
            }
            Format::E2m1 => {
                if let Some(g) = self.e2m1_scales(slot, dim).iter().position(|&e| e == 255) {
                    return Err(Error::reserved_scale(&field("k_scale"), g));
                }
            }
        }
        Ok(())
    }

    /// The same keys laid out flat (SPEC 3's order), with the pool slots as `k_slots`.
    pub fn gather(&self, batch: &Batch, dim: usize) -> FlatKeys {
        let l = batch.num_keys();
        let g = dim / 32;
        let mut slots = Array1::<i32>::zeros(l);
        let (mut codes, mut e4m3_scale, mut e2m1_scale) = match self.format {
            Format::E4m3 => (
                Array2::<u8>::zeros((l, dim)),
                Array1::<f32>::zeros(l),
                Array2::<u8>::zeros((0, g)),
            ),
            Format::E2m1 => (
                Array2::<u8>::zeros((l, dim / 2)),
                Array1::<f32>::zeros(0),
                Array2::<u8>::zeros((l, g)),
            ),
        };
        for (b, r) in batch.requests().iter().enumerate() {
            for j in 0..r.keys {
                let x = r.key_offset + j;
                let s = self.slot(b, j);
                slots[x] = s as i32;
                codes
                    .row_mut(x)
                    .assign(&ArrayView1::from(self.codes(s, dim)));
                match self.format {
                    Format::E4m3 => e4m3_scale[x] = self.e4m3_scale(s, dim),
                    Format::E2m1 => e2m1_scale
                        .row_mut(x)
                        .assign(&ArrayView1::from(self.e2m1_scales(s, dim))),
                }
            }
        }
        FlatKeys {
            format: self.format,
            codes,
            e4m3_scale,
            e2m1_scale,
            slots,
        }
    }
}

/// Keys laid out flat with their pool slots: a paged problem's keys gathered.
#[derive(Debug, Clone)]
pub struct FlatKeys {
    /// Element format.
    pub format: Format,
    /// E4M3 `[L, D]` or packed E2M1 `[L, D/2]`.
    pub codes: Array2<u8>,
    /// E4M3 keys: `[L]` per-key scales (empty for E2M1).
    pub e4m3_scale: Array1<f32>,
    /// E2M1 keys: `[L, G]` UE8M0 bytes (empty for E4M3).
    pub e2m1_scale: Array2<u8>,
    /// Pool slot of each flat key.
    pub slots: Array1<i32>,
}

impl FlatKeys {
    /// The flat [`crate::problem::Keys`] view.
    pub fn keys(&self) -> crate::problem::Keys<'_> {
        match self.format {
            Format::E4m3 => crate::problem::Keys::E4m3 {
                codes: self.codes.view(),
                scale: self.e4m3_scale.view(),
            },
            Format::E2m1 => crate::problem::Keys::E2m1 {
                packed: self.codes.view(),
                scale: self.e2m1_scale.view(),
            },
        }
    }
}
