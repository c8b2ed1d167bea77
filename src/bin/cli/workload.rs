//! Synthetic workloads: random inputs through the crate's own quantizers (SPEC 2),
//! shaped by a [`Shape`] or a named preset, and the reference's outputs as expected
//! tensors.

use crate::errors::Result;
use dsa_indexer::batch::Batch;
use dsa_indexer::dump::{Dump, Expected, KData, Layout, Meta, QData, RoleKind};
use dsa_indexer::formats::{quantize_fp4_blocks, quantize_fp8_rows, Fp4Floor, Fp8Scale};
use dsa_indexer::problem::Format;
use dsa_indexer::reference::Output;
use ndarray::{Array1, Array2, Array3};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Everything that shapes a synthetic layer-forward.
#[derive(Debug, Clone, PartialEq)]
pub struct Shape {
    pub heads: usize,
    pub dim: usize,
    pub topk: usize,
    pub ratio: usize,
    pub q_format: Format,
    pub k_format: Format,
    pub role: RoleKind,
    pub tail: Option<usize>,
    pub block_size: usize,
    pub num_blocks: usize,
    pub seq_lens: Vec<usize>,
    pub query_starts: Vec<usize>,
    /// Paged keys (SPEC 10) in pages of this many tokens; `None`: flat keys.
    pub page_size: Option<usize>,
    /// Decode rows: `q0_b = S_b - next_n`, recorded in the dump's metadata.
    pub next_n: Option<usize>,
    pub description: String,
}

/// The named presets (README and benches use them).
pub const PRESETS: &[(&str, &str)] = &[
    (
        "default",
        "the built-in `run` workload: V4.1-shaped (H=32, D=128, K=512, fp4 x fp4), \
         3 requests (cold 2048, prefix hit 2048 of 6144, cold 1024), 5120 rows",
    ),
    (
        "v41-replay",
        "fp4 x fp4, H=32, D=128, K=512: 2048 rows at the end of a 65536-key request",
    ),
    (
        "v41-source-tail",
        "the default workload as a source layer publishing its last 128 rows per request",
    ),
    (
        "v32",
        "DeepSeek-V3.2-shaped: fp8 x fp8, H=64, D=128, K=2048, 2 requests, 1536 rows",
    ),
    (
        "small",
        "fp4 x fp4, H=8, D=32, K=16, small B/NB, 2 requests, 40 rows (tests)",
    ),
];

impl Shape {
    /// A named preset.
    pub fn preset(name: &str) -> Result<Shape> {
        let v41 = |seq_lens: Vec<usize>, query_starts: Vec<usize>| Shape {
            heads: 32,
            dim: 128,
            topk: 512,
            ratio: 1,
            q_format: Format::E2m1,
            k_format: Format::E2m1,
            role: RoleKind::Plain,
            tail: None,
            block_size: 8,
            num_blocks: 2048,
            seq_lens,
            query_starts,
            page_size: None,
            next_n: None,
            description: String::new(),
        };
        let mut s = match name {
            "default" => v41(vec![2048, 6144, 1024], vec![0, 4096, 0]),
            "v41-replay" => v41(vec![65536], vec![65536 - 2048]),
            "v41-source-tail" => Shape {
                role: RoleKind::Source,
                tail: Some(128),
                ..v41(vec![2048, 6144, 1024], vec![0, 4096, 0])
            },
            "v32" => Shape {
                heads: 64,
                topk: 2048,
                q_format: Format::E4m3,
                k_format: Format::E4m3,
                ..v41(vec![4096, 1024], vec![3072, 512])
            },
            "small" => Shape {
                heads: 8,
                dim: 32,
                topk: 16,
                block_size: 2,
                num_blocks: 3,
                ..v41(vec![30, 25], vec![5, 10])
            },
            _ => bail!(
                "preset = {name:?}: expected one of {}",
                PRESETS.iter().map(|p| p.0).collect::<Vec<_>>().join(", ")
            ),
        };
        s.description = format!(
            "dsa-indexer gen preset {name}: {}",
            PRESETS.iter().find(|p| p.0 == name).map_or("", |p| p.1)
        );
        Ok(s)
    }

    fn meta(&self) -> Meta {
        Meta {
            heads: self.heads,
            dim: self.dim,
            topk: self.topk,
            ratio: self.ratio,
            q_format: self.q_format,
            k_format: self.k_format,
            role: self.role,
            block_size: self.block_size,
            num_blocks: self.num_blocks,
            page_cols: None,
            tail: self.tail,
            next_n: self.next_n,
            description: self.description.clone(),
        }
    }
}

/// A standard normal sample (Box-Muller), in f32.
pub fn normal(rng: &mut ChaCha8Rng) -> f32 {
    let u: f64 = rng.gen_range(f64::MIN_POSITIVE..1.0);
    let v: f64 = rng.gen();
    ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
}

/// The per-channel spread of [`engine_like_fp4`]: channel `c`'s values are a standard
/// normal times `2^u_c`, `u_c` uniform in `[-CHANNEL_LOG2_SPREAD, CHANNEL_LOG2_SPREAD]`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the GPU benchmark draws with it
pub const CHANNEL_LOG2_SPREAD: f32 = 2.0;

/// `n` per-channel exponents `u_c` for [`engine_like_fp4`], uniform in
/// `[-CHANNEL_LOG2_SPREAD, CHANNEL_LOG2_SPREAD]`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the GPU benchmark draws with it
pub fn channel_exponents(n: usize, rng: &mut ChaCha8Rng) -> Vec<f32> {
    (0..n)
        .map(|_| rng.gen_range(-CHANNEL_LOG2_SPREAD..=CHANNEL_LOG2_SPREAD))
        .collect()
}

/// Engine-like fp4 vectors: `n` vectors of `dim` f32 activations, element `c` of vector
/// `i` a standard normal times `2^u`, `u = channels[(i % p) * dim + c]` (`p =
/// channels.len() / dim`: the heads of a query row, or 1 for keys), each vector quantized
/// with SPEC 2's fp4 block quantizer (DeepGEMM's floor). Returns the packed codes
/// (`n * dim / 2` bytes) and the UE8M0 scales (`n * dim / 32`), vector after vector.
/// Vector `i` draws from stream `i` of ChaCha8 seeded with `seed`, so the result does not
/// depend on how many threads draw.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the GPU benchmark draws with it
pub fn engine_like_fp4(
    n: usize,
    dim: usize,
    channels: &[f32],
    seed: u64,
) -> Result<(Vec<u8>, Vec<u8>)> {
    use rayon::prelude::*;
    if dim == 0 || !dim.is_multiple_of(32) || channels.is_empty() {
        bail!("dim = {dim}: expected a positive multiple of 32 and a channel table");
    }
    if !channels.len().is_multiple_of(dim) {
        bail!(
            "channels.len = {}: expected a multiple of dim = {dim}",
            channels.len()
        );
    }
    let period = channels.len() / dim;
    let mut packed = vec![0u8; n * dim / 2];
    let mut scale = vec![0u8; n * dim / 32];
    packed
        .par_chunks_mut(dim / 2)
        .zip(scale.par_chunks_mut(dim / 32))
        .enumerate()
        .try_for_each_init(
            || vec![0f32; dim],
            |x, (i, (p, s))| -> dsa_indexer::Result<()> {
                let mut rng = ChaCha8Rng::seed_from_u64(seed);
                rng.set_stream(i as u64);
                let u = &channels[(i % period) * dim..][..dim];
                for (v, &e) in x.iter_mut().zip(u) {
                    *v = normal(&mut rng) * e.exp2();
                }
                let (cp, cs) = quantize_fp4_blocks(x, Fp4Floor::AmaxFloor)?;
                p.copy_from_slice(&cp);
                s.copy_from_slice(&cs);
                Ok(())
            },
        )?;
    Ok((packed, scale))
}

/// The stress draw of fp4 vectors: `bytes` random E2M1 bytes (any byte is two valid
/// codes) and `groups` UE8M0 scales, each uniform in 124..=130.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the GPU benchmark draws with it
pub fn uniform_scale_fp4(bytes: usize, groups: usize, rng: &mut ChaCha8Rng) -> (Vec<u8>, Vec<u8>) {
    let packed = (0..bytes).map(|_| rng.gen::<u8>()).collect();
    let scale = (0..groups).map(|_| rng.gen_range(124u8..=130)).collect();
    (packed, scale)
}

/// A flat run of keys in either format: E4M3 codes `[n, D]` with `[n]` f32 scales, or
/// packed E2M1 `[n, D/2]` with `[n, D/32]` UE8M0 bytes.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the GPU benchmark draws with it
pub enum FlatRun {
    E4m3 { codes: Vec<u8>, scale: Vec<f32> },
    E2m1 { packed: Vec<u8>, scale: Vec<u8> },
}

/// `n` E4M3 keys as `dsa-indexer bench` draws them: uniform bytes with the NaN codes
/// (`b & 0x7F == 0x7F`) mapped to `b & 0xF7`, per-key scales uniform in [0.5, 2).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the GPU benchmark draws with it
pub fn e4m3_keys(n: usize, dim: usize, rng: &mut ChaCha8Rng) -> FlatRun {
    let mut codes = vec![0u8; n * dim];
    rng.fill(&mut codes[..]);
    for b in codes.iter_mut() {
        if *b & 0x7F == 0x7F {
            *b &= 0xF7;
        }
    }
    let scale = (0..n).map(|_| rng.gen_range(0.5f32..2.0)).collect();
    FlatRun::E4m3 { codes, scale }
}

/// Keys in a page pool (SPEC 10) and its page table.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the GPU benchmark draws with it
pub struct PagePool {
    /// `u8 [pages, P * bytes_per_token]`.
    pub kv_cache: Array2<u8>,
    /// `i32 [B, max_b ceil(L_b / P)]`, -1 past a request's pages.
    pub page_table: Array2<i32>,
    pub page_size: usize,
}

/// Request `b`'s `lens[b]` keys, `draw(b)`, written into a pool of exactly the pages the
/// requests use (`sum_b ceil(L_b / P)`), the pages handed out in a random order (a
/// permutation of the pool from `rng`), so a request's pages are neither contiguous nor
/// in order. The slots of a last page past `L_b` stay zero.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the GPU benchmark draws with it
pub fn page_pool(
    format: Format,
    dim: usize,
    page_size: usize,
    lens: &[usize],
    rng: &mut ChaCha8Rng,
    mut draw: impl FnMut(usize) -> Result<FlatRun>,
) -> Result<PagePool> {
    use rand::seq::SliceRandom;
    if !(page_size.is_power_of_two() && page_size <= dsa_indexer::paged::MAX_PAGE_SIZE) {
        bail!("page_size = {page_size}: expected a power of two in 1..=256");
    }
    if dim == 0 || !dim.is_multiple_of(32) {
        bail!("dim = {dim}: expected a positive multiple of 32");
    }
    let (p, g) = (page_size, dim / 32);
    let used: Vec<usize> = lens.iter().map(|l| l.div_ceil(p)).collect();
    let pages: usize = used.iter().sum();
    let width = used.iter().copied().max().unwrap_or(0);
    let bpt = dsa_indexer::paged::bytes_per_token(format, dim);
    let mut ids: Vec<i32> = (0..pages as i32).collect();
    ids.shuffle(rng);
    let mut kv_cache = Array2::<u8>::zeros((pages, p * bpt));
    let mut page_table = Array2::<i32>::from_elem((lens.len(), width), -1);
    let mut next = 0;
    for (b, &l) in lens.iter().enumerate() {
        let run = draw(b)?;
        let fits = match &run {
            FlatRun::E4m3 { codes, scale } => codes.len() == l * dim && scale.len() == l,
            FlatRun::E2m1 { packed, scale } => packed.len() == l * dim / 2 && scale.len() == l * g,
        };
        if !fits {
            bail!("page pool: request {b}'s keys are not {l} keys of dim {dim}");
        }
        for e in 0..used[b] {
            let id = ids[next];
            next += 1;
            page_table[[b, e]] = id;
            let mut row = kv_cache.row_mut(id as usize);
            let page = row
                .as_slice_mut()
                .ok_or_else(|| crate::errors::CliError::input("page pool: a strided page"))?;
            let (j0, n) = (e * p, (l - e * p).min(p));
            match (&run, format) {
                (FlatRun::E4m3 { codes, scale }, Format::E4m3) => {
                    page[..n * dim].copy_from_slice(&codes[j0 * dim..(j0 + n) * dim]);
                    for t in 0..n {
                        let at = p * dim + 4 * t;
                        page[at..at + 4].copy_from_slice(&scale[j0 + t].to_le_bytes());
                    }
                }
                (FlatRun::E2m1 { packed, scale }, Format::E2m1) => {
                    let h = dim / 2;
                    page[..n * h].copy_from_slice(&packed[j0 * h..(j0 + n) * h]);
                    let at = p * h;
                    page[at..at + n * g].copy_from_slice(&scale[j0 * g..(j0 + n) * g]);
                }
                _ => bail!("page pool of {format} keys: request {b}'s keys are in another format"),
            }
        }
    }
    Ok(PagePool {
        kv_cache,
        page_table,
        page_size,
    })
}

/// Random inputs for `shape` (no expected outputs yet). Values are normal with a
/// per-vector magnitude spread, quantized with the crate's quantizers; an E4M3
/// query's scale is folded into its weight (SPEC 4).
pub fn synth(shape: &Shape, seed: u64) -> Result<Dump> {
    let batch = Batch::contiguous(&shape.seq_lens, &shape.query_starts, shape.ratio)?;
    let (t, l, h, d) = (batch.num_rows(), batch.num_keys(), shape.heads, shape.dim);
    if !(h.is_power_of_two() && (8..=64).contains(&h)) {
        bail!("heads = {h}: expected a power of two in 8..=64");
    }
    if ![32, 64, 128].contains(&d) {
        bail!("dim = {d}: expected 32, 64 or 128");
    }
    let g = d / 32;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut x = vec![0f32; d];
    let fill = |rng: &mut ChaCha8Rng, x: &mut [f32]| {
        let m = (normal(rng) * 0.5).exp();
        x.iter_mut().for_each(|v| *v = normal(rng) * m);
    };
    let mut weights = Array2::from_shape_fn((t, h), |_| normal(&mut rng) * 0.25);
    let q = match shape.q_format {
        Format::E2m1 => {
            let mut packed = Array3::zeros((t, h, d / 2));
            let mut scale = Array3::zeros((t, h, g));
            for i in 0..t {
                for hh in 0..h {
                    fill(&mut rng, &mut x);
                    let (p, s) = quantize_fp4_blocks(&x, Fp4Floor::AmaxFloor)?;
                    packed
                        .slice_mut(ndarray::s![i, hh, ..])
                        .assign(&Array1::from(p));
                    scale
                        .slice_mut(ndarray::s![i, hh, ..])
                        .assign(&Array1::from(s));
                }
            }
            QData::E2m1 { packed, scale }
        }
        Format::E4m3 => {
            let mut codes = Array3::zeros((t, h, d));
            for i in 0..t {
                for hh in 0..h {
                    fill(&mut rng, &mut x);
                    let (c, s) = quantize_fp8_rows(&x, Fp8Scale::Exact)?;
                    codes
                        .slice_mut(ndarray::s![i, hh, ..])
                        .assign(&Array1::from(c));
                    weights[[i, hh]] *= s;
                }
            }
            QData::E4m3(codes)
        }
    };
    let k = match shape.k_format {
        Format::E2m1 => {
            let mut packed = Array2::zeros((l, d / 2));
            let mut scale = Array2::zeros((l, g));
            for j in 0..l {
                fill(&mut rng, &mut x);
                let (p, s) = quantize_fp4_blocks(&x, Fp4Floor::AmaxFloor)?;
                packed.row_mut(j).assign(&Array1::from(p));
                scale.row_mut(j).assign(&Array1::from(s));
            }
            KData::E2m1 { packed, scale }
        }
        Format::E4m3 => {
            let mut codes = Array2::zeros((l, d));
            let mut scale = Array1::zeros(l);
            for j in 0..l {
                fill(&mut rng, &mut x);
                let (c, s) = quantize_fp8_rows(&x, Fp8Scale::Exact)?;
                codes.row_mut(j).assign(&Array1::from(c));
                scale[j] = s;
            }
            KData::E4m3 { codes, scale }
        }
    };
    let k = match shape.page_size {
        Some(p) => page_keys(&batch, &k, shape.k_format, d, p, seed)?,
        None => k,
    };
    let mut dump = Dump {
        meta: shape.meta(),
        seq_lens: shape.seq_lens.clone(),
        layout: Layout::Contiguous(shape.query_starts.clone()),
        q,
        k,
        weights,
        k_slots: None,
        candidates: None,
        engine_logits: None,
        expected: Expected::default(),
    };
    if shape.role == RoleKind::Consumer {
        // The consumer's candidates: what a source over the same batch publishes.
        let mut src = dump.clone();
        src.meta.role = RoleKind::Source;
        src.meta.tail = None;
        let b = src.batch()?;
        let p = src.problem(&b, None)?;
        let (out, _) = dsa_indexer::indexer::run_cpu(&p, dsa_indexer::plan::DEFAULT_BUDGET)?;
        dump.candidates = out.published.map(|pb| pb.blocks);
        dump.meta.tail = None;
    }
    Ok(dump)
}

/// The flat keys `k` of `batch` in a page pool of `p` tokens a page (SPEC 10), as an
/// engine leaves it: each request's pages at random page ids, a quarter more pages than
/// the requests use holding random bytes (NaN codes, bad scales, UE8M0 255), random
/// bytes in the slots past each request's last key, and `-1` past its used entries of
/// the page table. The draws come from their own stream, so the flat keys, and a flat
/// dump, do not depend on them.
fn page_keys(
    batch: &Batch,
    k: &KData,
    format: Format,
    dim: usize,
    p: usize,
    seed: u64,
) -> Result<KData> {
    use dsa_indexer::paged::{bytes_per_token, MAX_PAGE_SIZE};
    use rand::seq::SliceRandom;
    if !(p.is_power_of_two() && p <= MAX_PAGE_SIZE) {
        bail!("page_size = {p}: expected a power of two in 1..=256");
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(1);
    let reqs = batch.requests();
    let used: Vec<usize> = reqs.iter().map(|r| r.keys.div_ceil(p)).collect();
    let total: usize = used.iter().sum();
    let pages = total + total.div_ceil(4).max(1);
    let mut ids: Vec<i32> = (0..pages as i32).collect();
    ids.shuffle(&mut rng);
    let width = p * bytes_per_token(format, dim);
    let mut kv_cache = Array2::<u8>::zeros((pages, width));
    kv_cache.iter_mut().for_each(|b| *b = rng.gen());
    let mut page_table = Array2::from_elem(
        (reqs.len(), used.iter().copied().max().unwrap_or(0).max(1)),
        -1,
    );
    let mut next = ids.iter();
    for (b, r) in reqs.iter().enumerate() {
        for e in 0..used[b] {
            page_table[[b, e]] = *next.next().unwrap_or(&0);
        }
        for j in 0..r.keys {
            let x = r.key_offset + j;
            let mut page = kv_cache.row_mut(page_table[[b, j / p]] as usize);
            let page = page.as_slice_mut().unwrap_or_default();
            let t = j % p;
            match k {
                KData::E4m3 { codes, scale } => {
                    page[t * dim..(t + 1) * dim]
                        .copy_from_slice(codes.row(x).as_slice().unwrap_or_default());
                    page[p * dim + 4 * t..][..4].copy_from_slice(&scale[x].to_le_bytes());
                }
                KData::E2m1 { packed, scale } => {
                    let (w, g) = (dim / 2, dim / 32);
                    page[t * w..(t + 1) * w]
                        .copy_from_slice(packed.row(x).as_slice().unwrap_or_default());
                    page[p * w + t * g..][..g]
                        .copy_from_slice(scale.row(x).as_slice().unwrap_or_default());
                }
                KData::Paged { .. } => bail!("page_keys: the keys are paged already"),
            }
        }
    }
    Ok(KData::Paged {
        kv_cache,
        page_table,
        page_size: p,
    })
}

/// Fill `dump.expected` from the outputs `out` of its problem (and, when `logits` is
/// given, the concatenated visible logits). A paged dump carries no `expected_ks` /
/// `expected_ke`: they index a flat key buffer, which it does not have.
pub fn set_expected(dump: &mut Dump, batch: &Batch, out: &Output, logits: Option<Vec<f32>>) {
    let flat = !matches!(dump.k, KData::Paged { .. });
    let e = &mut dump.expected;
    e.ks = flat.then(|| batch.rows().iter().map(|r| r.ks as i32).collect());
    e.ke = flat.then(|| batch.rows().iter().map(|r| r.ke() as i32).collect());
    e.raw = Some(out.raw.clone());
    e.page = Some(out.page.clone());
    if let Some(pb) = &out.published {
        e.published = Some(pb.blocks.clone());
        let set: std::collections::HashSet<(usize, usize)> = pb.rows.iter().copied().collect();
        let rows: Vec<i32> = batch
            .rows()
            .iter()
            .enumerate()
            .filter(|(_, r)| set.contains(&(r.request, r.position)))
            .map(|(i, _)| i as i32)
            .collect();
        e.published_rows = Some(rows);
    }
    e.logits = logits;
}

#[cfg(test)]
mod tests {
    use super::*;
    use dsa_indexer::formats::{e2m1, ue8m0};

    /// Per vector of `g` group scales: the span `max - min` of its UE8M0 bytes.
    fn spans(scale: &[u8], g: usize) -> Vec<u8> {
        scale
            .chunks(g)
            .map(|s| s.iter().max().unwrap() - s.iter().min().unwrap())
            .collect()
    }

    fn share(v: &[u8], f: impl Fn(u8) -> bool) -> f64 {
        v.iter().filter(|&&x| f(x)).count() as f64 / v.len() as f64
    }

    /// The engine-like draw: group scales within a few binades of each other (the
    /// stress draw's spread up to 6), valid scale bytes, and the per-channel spread
    /// visible in the decoded values.
    #[test]
    fn engine_like_fp4_scales_span_few_binades() {
        let (n, d, heads) = (8192, 128, 32);
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let ch = channel_exponents(heads * d, &mut rng);
        let (packed, scale) = engine_like_fp4(n, d, &ch, 11).unwrap();
        assert!(scale.iter().all(|&e| (1..=254).contains(&e)));
        // About 84 % of the vectors span at most 1 binade, 99.5 % at most 2, the rest 3.
        let sp = spans(&scale, d / 32);
        let (le2, max) = (share(&sp, |s| s <= 2), *sp.iter().max().unwrap());
        println!(
            "engine-like: span <= 1: {:.4}, <= 2: {le2:.4}, max span {max}",
            share(&sp, |s| s <= 1)
        );
        assert!(max <= 4, "max span {max}");
        assert!(le2 >= 0.98, "span <= 2 in {le2}");
        // Per-channel RMS of the decoded values: the channels' 2^u_c shows as a spread of
        // about 2 * CHANNEL_LOG2_SPREAD binades between the quietest and loudest channel
        // (4.3 here: the quantizer rounds the quietest channels coarsely).
        let mut ss = vec![0f64; heads * d];
        for (i, (p, s)) in packed.chunks(d / 2).zip(scale.chunks(d / 32)).enumerate() {
            for c in 0..d {
                let v = e2m1::decode(e2m1::unpack(p, c)) * ue8m0::decode(s[c / 32]);
                ss[(i % heads) * d + c] += f64::from(v) * f64::from(v);
            }
        }
        let lg: Vec<f64> = ss.iter().map(|&x| 0.5 * x.log2()).collect();
        let spread = lg.iter().cloned().fold(f64::MIN, f64::max)
            - lg.iter().cloned().fold(f64::MAX, f64::min);
        println!("per-channel RMS spread: {spread:.2} binades");
        assert!((3.0..=5.0).contains(&spread), "spread {spread}");
        // The stress draw, for contrast: spans of 4 binades or more are common.
        let (_, wide) = uniform_scale_fp4(n * d / 2, n * d / 32, &mut rng);
        let ws = spans(&wide, d / 32);
        let ge4 = share(&ws, |s| s >= 4);
        println!("uniform scales: span >= 4: {ge4:.4}");
        assert!(ge4 >= 0.3 && *ws.iter().max().unwrap() == 6);
    }

    /// Vector `i` draws from its own stream: one thread and many give the same bytes,
    /// and a vector does not depend on how many come before it.
    #[test]
    fn engine_like_fp4_is_independent_of_threads_and_count() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let ch = channel_exponents(4 * 64, &mut rng);
        let many = engine_like_fp4(300, 64, &ch, 9).unwrap();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        let one = pool.install(|| engine_like_fp4(300, 64, &ch, 9).unwrap());
        assert_eq!(many, one);
        let few = engine_like_fp4(7, 64, &ch, 9).unwrap();
        assert_eq!(few.0[..], many.0[..7 * 32]);
        assert_eq!(few.1[..], many.1[..7 * 2]);
        assert!(engine_like_fp4(1, 48, &ch, 9).is_err());
        assert!(engine_like_fp4(1, 64, &ch[..100], 9).is_err());
    }

    /// The decode benchmark's pool: read back through the page table (SPEC 10's
    /// layout, as the library gathers it) it gives the keys drawn, in either format;
    /// every pool page is used exactly once, the rest of the table is -1.
    #[test]
    fn page_pool_reads_back_the_keys_drawn() {
        use dsa_indexer::paged::PagedKeys;
        let (d, p) = (128, 16);
        let lens = [130usize, 64, 1, 17];
        let q0: Vec<usize> = lens.iter().map(|l| l - 1).collect();
        let batch = Batch::contiguous(&lens, &q0, 1).unwrap();
        for format in [Format::E4m3, Format::E2m1] {
            let mut rng = ChaCha8Rng::seed_from_u64(9);
            let mut drawn = Vec::new();
            let pool = page_pool(format, d, p, &lens, &mut rng, |b| {
                let mut r = ChaCha8Rng::seed_from_u64(100 + b as u64);
                let run = match format {
                    Format::E4m3 => e4m3_keys(lens[b], d, &mut r),
                    Format::E2m1 => {
                        let (packed, scale) =
                            uniform_scale_fp4(lens[b] * d / 2, lens[b] * d / 32, &mut r);
                        FlatRun::E2m1 { packed, scale }
                    }
                };
                let copy = match &run {
                    FlatRun::E4m3 { codes, scale } => FlatRun::E4m3 {
                        codes: codes.clone(),
                        scale: scale.clone(),
                    },
                    FlatRun::E2m1 { packed, scale } => FlatRun::E2m1 {
                        packed: packed.clone(),
                        scale: scale.clone(),
                    },
                };
                drawn.push(copy);
                Ok(run)
            })
            .unwrap();
            let pages: usize = lens.iter().map(|l| l.div_ceil(p)).sum();
            assert_eq!(pool.kv_cache.nrows(), pages);
            let mut ids: Vec<i32> = pool
                .page_table
                .iter()
                .copied()
                .filter(|&x| x >= 0)
                .collect();
            assert_eq!(ids.len(), pages);
            ids.sort_unstable();
            assert_eq!(ids, (0..pages as i32).collect::<Vec<_>>());
            // Random order: request 0's nine pages are not 0..9.
            assert_ne!(
                pool.page_table.row(0).to_vec(),
                (0..9).collect::<Vec<i32>>()
            );
            for (b, l) in lens.iter().enumerate() {
                let row = pool.page_table.row(b);
                assert!(row.iter().skip(l.div_ceil(p)).all(|&x| x == -1));
            }
            let pk = PagedKeys {
                format,
                kv_cache: pool.kv_cache.view(),
                page_table: pool.page_table.view(),
                page_size: pool.page_size,
            };
            pk.validate(&batch, d).unwrap();
            let flat = pk.gather(&batch, d);
            let mut codes = Vec::new();
            let (mut fs, mut us) = (Vec::new(), Vec::new());
            for run in &drawn {
                match run {
                    FlatRun::E4m3 { codes: c, scale } => {
                        codes.extend_from_slice(c);
                        fs.extend_from_slice(scale);
                    }
                    FlatRun::E2m1 { packed, scale } => {
                        codes.extend_from_slice(packed);
                        us.extend_from_slice(scale);
                    }
                }
            }
            assert_eq!(flat.codes.as_slice().unwrap(), &codes[..], "{format}");
            assert_eq!(flat.e4m3_scale.as_slice().unwrap(), &fs[..], "{format}");
            assert_eq!(flat.e2m1_scale.as_slice().unwrap(), &us[..], "{format}");
        }
    }

    /// A draw of the wrong length or format is an error naming the request, not a panic.
    #[test]
    fn page_pool_refuses_a_draw_that_does_not_fit() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let short = page_pool(Format::E4m3, 128, 64, &[10, 5], &mut rng, |b| {
            Ok(e4m3_keys(
                if b == 1 { 4 } else { 10 },
                128,
                &mut ChaCha8Rng::seed_from_u64(2),
            ))
        });
        assert!(short.err().unwrap().msg.contains("request 1"));
        let other = page_pool(Format::E2m1, 128, 64, &[10], &mut rng, |_| {
            Ok(e4m3_keys(10, 128, &mut ChaCha8Rng::seed_from_u64(2)))
        });
        assert!(other.is_err());
        assert!(page_pool(Format::E4m3, 128, 48, &[10], &mut rng, |_| unreachable!()).is_err());
    }
}
