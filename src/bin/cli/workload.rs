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
            description: self.description.clone(),
        }
    }
}

/// A standard normal sample (Box-Muller), in f32.
fn normal(rng: &mut ChaCha8Rng) -> f32 {
    let u: f64 = rng.gen_range(f64::MIN_POSITIVE..1.0);
    let v: f64 = rng.gen();
    ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
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

/// Fill `dump.expected` from the outputs `out` of its problem (and, when `logits` is
/// given, the concatenated visible logits).
pub fn set_expected(dump: &mut Dump, batch: &Batch, out: &Output, logits: Option<Vec<f32>>) {
    let e = &mut dump.expected;
    e.ks = Some(batch.rows().iter().map(|r| r.ks as i32).collect());
    e.ke = Some(batch.rows().iter().map(|r| r.ke() as i32).collect());
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
