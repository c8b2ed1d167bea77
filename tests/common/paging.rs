//! A flat problem's keys laid out in a page pool (SPEC 10), the way an engine leaves
//! them: a random page size, page ids in random order with holes, shared leading pages
//! between requests, and garbage wherever no request reads (unused pages, the slots of
//! a last page past `L_b`, table entries past `ceil(L_b / P)`).
//!
//! Shared prefixes are made in the flat problem first (one request's leading keys
//! copied into another's), so that the flat and the paged problem stay the same
//! problem. Every choice comes from `draw(n)`, uniform in `0..n`, so the property tests
//! (a seeded `rand` generator) and the `paged` fuzz target (the fuzzer's bytes) share
//! this file; it needs only `dsa_indexer` and `ndarray`.

use dsa_indexer::dump::{Dump, KData};
use dsa_indexer::paged::{bytes_per_token, MAX_PAGE_SIZE};
use dsa_indexer::problem::Format;
use ndarray::{Array1, Array2};

/// A source of choices: `draw(n)` is uniform in `0..n` (`n >= 1`).
pub type Draw<'a> = &'a mut dyn FnMut(usize) -> usize;

/// The two layouts of one problem.
#[derive(Debug, Clone)]
pub struct Paged {
    /// The flat problem, shared prefixes copied in, `k_slots` the pool slots.
    pub flat: Dump,
    /// The same problem over `kv_cache` / `page_table` (no `k_slots`).
    pub paged: Dump,
    /// `P`.
    pub page_size: usize,
    /// Pool slot of every flat key, `[L]` (SPEC 10: `page_table[b, j / P] * P + j % P`).
    pub slots: Array1<i32>,
    /// `(request, donor, pages)`: request's first `pages` table entries are the donor's.
    pub shared: Vec<(usize, usize, usize)>,
    /// Pages no request uses.
    pub holes: usize,
}

/// Garbage E4M3 code bytes for unread slots: both NaN codes, or any byte.
fn junk_e4m3(draw: Draw) -> u8 {
    [0x7F, 0xFF, draw(256) as u8][draw(3)]
}

/// Garbage f32 key scales for unread slots.
fn junk_scale(draw: Draw) -> f32 {
    [
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        0.0,
        -0.0,
        -1.5,
        f32::from_bits(draw(1 << 31) as u32 * 2 + draw(2) as u32),
    ][draw(7)]
}

/// Garbage UE8M0 bytes for unread slots: the reserved 255, or any byte.
fn junk_ue8m0(draw: Draw) -> u8 {
    [255, draw(256) as u8][draw(2)]
}

/// Copy the first `n` keys of flat key range `from..` over those at `to..`.
fn copy_keys(k: &mut KData, from: usize, to: usize, n: usize) {
    for x in 0..n {
        match k {
            KData::E4m3 { codes, scale } => {
                let row = codes.row(from + x).to_owned();
                codes.row_mut(to + x).assign(&row);
                scale[to + x] = scale[from + x];
            }
            KData::E2m1 { packed, scale } => {
                let row = packed.row(from + x).to_owned();
                packed.row_mut(to + x).assign(&row);
                let row = scale.row(from + x).to_owned();
                scale.row_mut(to + x).assign(&row);
            }
            KData::Paged { .. } => unreachable!("flat keys"),
        }
    }
}

/// Lay out the keys of the flat dump `d` in pages of `1 << draw(9)` tokens (or
/// `page_size` when given). Requests keep SPEC 3's key order; the consumer's
/// candidates, the queries and the rows are untouched.
pub fn page(d: &Dump, page_size: Option<usize>, draw: Draw) -> Paged {
    let batch = d.batch().expect("a valid flat dump");
    let reqs = batch.requests().to_vec();
    let dim = d.meta.dim;
    let format = d.meta.k_format;
    let p = page_size.unwrap_or_else(|| 1 << draw(9));
    assert!(p.is_power_of_two() && p <= MAX_PAGE_SIZE);
    let mut flat = d.clone();

    // Shared prefixes: request b takes a donor a < b's first full pages, keys copied
    // first (in request order, so a donor's own shared prefix is copied already).
    let mut shared = Vec::new();
    for b in 1..reqs.len() {
        if draw(3) != 0 {
            continue;
        }
        let a = draw(b);
        let full = reqs[a].keys.min(reqs[b].keys) / p;
        if full == 0 {
            continue;
        }
        let pages = 1 + draw(full);
        copy_keys(
            &mut flat.k,
            reqs[a].key_offset,
            reqs[b].key_offset,
            pages * p,
        );
        shared.push((b, a, pages));
    }
    let donor = |b: usize| shared.iter().find(|s| s.0 == b).map(|s| (s.1, s.2));

    // Page ids: a random permutation of the pool, taken in order by each unshared
    // entry; the ids left over are holes.
    let need: Vec<usize> = reqs.iter().map(|r| r.keys.div_ceil(p)).collect();
    let own: usize = (0..reqs.len())
        .map(|b| need[b] - donor(b).map_or(0, |s| s.1))
        .sum();
    let holes = draw(4);
    let num_pages = own + holes;
    let mut ids: Vec<i32> = (0..num_pages as i32).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, draw(i + 1));
    }
    let width = need.iter().copied().max().unwrap_or(0) + draw(3);
    let mut table = Array2::<i32>::zeros((reqs.len(), width));
    let mut next = ids.iter().copied();
    for b in 0..reqs.len() {
        for e in 0..width {
            table[[b, e]] = if e >= need[b] {
                // Ignored entries: -1, an id in range, or any i32.
                let any = draw(1 << 31) as i32;
                let in_range = if num_pages > 0 {
                    draw(num_pages) as i32
                } else {
                    -1
                };
                [-1, in_range, any, -any - 1, num_pages as i32][draw(5)]
            } else {
                match donor(b) {
                    Some((a, pages)) if e < pages => table[[a, e]],
                    _ => next.next().expect("one id per unshared entry"),
                }
            };
        }
    }

    // The pool: garbage everywhere, then every key at its slot.
    let bpt = bytes_per_token(format, dim);
    let mut kv = Array2::<u8>::zeros((num_pages, p * bpt));
    let codes_w = match format {
        Format::E4m3 => dim,
        Format::E2m1 => dim / 2,
    };
    let g = dim / 32;
    for mut row in kv.rows_mut() {
        let row = row.as_slice_mut().expect("row-major");
        match format {
            Format::E4m3 => {
                row[..p * dim].iter_mut().for_each(|x| *x = junk_e4m3(draw));
                for t in 0..p {
                    row[p * dim + 4 * t..p * dim + 4 * t + 4]
                        .copy_from_slice(&junk_scale(draw).to_le_bytes());
                }
            }
            Format::E2m1 => {
                row[..p * codes_w]
                    .iter_mut()
                    .for_each(|x| *x = draw(256) as u8);
                row[p * codes_w..]
                    .iter_mut()
                    .for_each(|x| *x = junk_ue8m0(draw));
            }
        }
    }
    let mut slots = Array1::<i32>::zeros(batch.num_keys());
    for (b, r) in reqs.iter().enumerate() {
        for j in 0..r.keys {
            let x = r.key_offset + j;
            let (pg, t) = (table[[b, j / p]] as usize, j % p);
            slots[x] = (pg * p + t) as i32;
            let row = kv.row_mut(pg).into_slice().expect("row-major");
            match &flat.k {
                KData::E4m3 { codes, scale } => {
                    row[t * dim..(t + 1) * dim].copy_from_slice(codes.row(x).as_slice().unwrap());
                    row[p * dim + 4 * t..p * dim + 4 * t + 4]
                        .copy_from_slice(&scale[x].to_le_bytes());
                }
                KData::E2m1 { packed, scale } => {
                    row[t * codes_w..(t + 1) * codes_w]
                        .copy_from_slice(packed.row(x).as_slice().unwrap());
                    let at = p * codes_w + t * g;
                    row[at..at + g].copy_from_slice(scale.row(x).as_slice().unwrap());
                }
                KData::Paged { .. } => unreachable!("flat keys"),
            }
        }
    }
    flat.k_slots = Some(slots.clone());
    let mut paged = flat.clone();
    paged.k = KData::Paged {
        kv_cache: kv,
        page_table: table,
        page_size: p,
    };
    paged.k_slots = None;
    Paged {
        flat,
        paged,
        page_size: p,
        slots,
        shared,
        holes,
    }
}
