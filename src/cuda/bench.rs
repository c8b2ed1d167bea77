//! Benchmark workloads (issue 7), timed with CUDA events on the backend's stream.
//!
//! Each workload is generated on the host from a fixed seed (random codes, scales near
//! 1, weights in [-1, 1)), uploaded once, then the whole indexer (every tile: logits,
//! candidate blocks, top-k, index assembly) is timed between two events, after a
//! warm-up, as the median of `reps` runs. The logits and the selection halves are timed
//! separately too (each tile's kernels between their own events, summed over tiles).

use rand::{Rng, SeedableRng};

use super::{drv, CudaBackend, FoldCounts, TopkPaths};
use crate::batch::Batch;
use crate::error::{Error, Result};
use crate::indexer::Backend;
use crate::problem::{Inputs, Keys, Params, Problem, Queries, Role};

/// A named workload of issue 7.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Workload {
    /// Name (`v32-16k`, ...).
    pub name: &'static str,
    /// fp4 x fp4 (V4.1) or fp8 x fp8 with per-key scales (V3.2).
    pub fp4: bool,
    /// `H`.
    pub heads: usize,
    /// `D`.
    pub dim: usize,
    /// `K`.
    pub topk: usize,
    /// `S` of the one request.
    pub seq_len: usize,
    /// Query rows: the last `rows` positions.
    pub rows: usize,
    /// Logits budget in bytes.
    pub budget: usize,
    /// Source layer with this tail (`None`: plain).
    pub source_tail: Option<usize>,
}

const GIB: usize = 1 << 30;

/// The workload table.
pub const WORKLOADS: &[Workload] = &[
    Workload {
        name: "v32-16k",
        fp4: false,
        heads: 64,
        dim: 128,
        topk: 2048,
        seq_len: 16384,
        rows: 16384,
        budget: 2 * GIB,
        source_tail: None,
    },
    Workload {
        name: "v32-64k",
        fp4: false,
        heads: 64,
        dim: 128,
        topk: 2048,
        seq_len: 65536,
        rows: 65536,
        budget: 2 * GIB,
        source_tail: None,
    },
    Workload {
        name: "v41-chunk",
        fp4: true,
        heads: 32,
        dim: 128,
        topk: 512,
        seq_len: 262144,
        rows: 4096,
        budget: 2 * GIB,
        source_tail: None,
    },
    Workload {
        name: "v41-chunk-source",
        fp4: true,
        heads: 32,
        dim: 128,
        topk: 512,
        seq_len: 262144,
        rows: 4096,
        budget: 2 * GIB,
        source_tail: Some(128),
    },
    Workload {
        name: "v41-1m",
        fp4: true,
        heads: 32,
        dim: 128,
        topk: 512,
        seq_len: 1 << 20,
        rows: 16384,
        budget: 2 * GIB,
        source_tail: None,
    },
    Workload {
        name: "v41-1m-256m",
        fp4: true,
        heads: 32,
        dim: 128,
        topk: 512,
        seq_len: 1 << 20,
        rows: 16384,
        budget: 256 << 20,
        source_tail: None,
    },
];

/// Look a workload up by name.
pub fn workload(name: &str) -> Result<Workload> {
    WORKLOADS
        .iter()
        .find(|w| w.name == name)
        .copied()
        .ok_or_else(|| {
            Error::range(
                "workload",
                name,
                "one of v32-16k, v32-64k, v41-chunk, v41-chunk-source, v41-1m, v41-1m-256m",
            )
        })
}

/// What one workload measured.
#[derive(Debug, Clone, PartialEq)]
pub struct BenchResult {
    /// Workload name.
    pub name: String,
    /// GPU name.
    pub device: String,
    /// Query rows.
    pub rows: usize,
    /// `sum n`.
    pub valid_pairs: u64,
    /// Tiles of the plan.
    pub tiles: usize,
    /// Budget (bytes).
    pub budget: usize,
    /// Median end-to-end time of all tiles (ms).
    pub median_ms: f64,
    /// Fastest run (ms).
    pub min_ms: f64,
    /// Median of the logits kernels' time summed over tiles (ms).
    pub logits_ms: f64,
    /// Median of the selection kernels' time (block keys, kept blocks, top-k) (ms).
    pub select_ms: f64,
    /// `2 * valid_pairs * H * D / median` in TFLOP/s.
    pub tflops: f64,
    /// `2 * valid_pairs * H * D / logits_ms` in TFLOP/s.
    pub logits_tflops: f64,
    /// `4 * valid_pairs / select_ms` in GB/s (logits read by the selection).
    pub topk_gbs: f64,
    /// Rows per second end to end.
    pub rows_per_s: f64,
    /// Measured transient device bytes.
    pub measured_peak: usize,
    /// Planned peak transient bytes.
    pub planned_peak: usize,
    /// Runs timed.
    pub reps: usize,
    /// Row selections per run by top-k path: the counters of all runs over the number of
    /// runs.
    pub topk_paths: TopkPaths,
    /// Exact-class fold counters per run (zero outside the exact class).
    pub fold_counts: FoldCounts,
}

impl BenchResult {
    /// One JSON object.
    pub fn to_json(&self) -> String {
        serde_json::json!({
            "name": self.name, "device": self.device, "rows": self.rows,
            "valid_pairs": self.valid_pairs, "tiles": self.tiles, "budget": self.budget,
            "median_ms": self.median_ms, "min_ms": self.min_ms, "logits_ms": self.logits_ms,
            "select_ms": self.select_ms, "tflops": self.tflops, "logits_tflops": self.logits_tflops,
            "topk_gbs": self.topk_gbs, "rows_per_s": self.rows_per_s,
            "measured_peak": self.measured_peak, "planned_peak": self.planned_peak, "reps": self.reps,
            "topk_paths": {
                "all": self.topk_paths.all, "short": self.topk_paths.short,
                "sampled": self.topk_paths.sampled, "two_pass": self.topk_paths.two_pass,
                "general": self.topk_paths.general,
            },
            "fold_counts": {
                "query_blocks_folded": self.fold_counts.query_blocks_folded,
                "query_blocks_plain": self.fold_counts.query_blocks_plain,
                "threads_one_multiply": self.fold_counts.threads_one_multiply,
                "threads_two_multiplies": self.fold_counts.threads_two_multiplies,
            },
        })
        .to_string()
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        0.0
    } else {
        v[v.len() / 2]
    }
}

/// Run workload `w` `reps` times (after one warm-up) and report.
pub fn run_workload(b: &mut CudaBackend, w: &Workload, reps: usize) -> Result<BenchResult> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0x5eed);
    let batch = Batch::contiguous(&[w.seq_len], &[w.seq_len - w.rows], 1)?;
    let (t, l, h, d) = (batch.num_rows(), batch.num_keys(), w.heads, w.dim);
    let g = d / 32;
    let weights = ndarray::Array2::from_shape_fn((t, h), |_| rng.gen_range(-1.0f32..1.0));
    // E4M3 bytes away from the NaN codes; E2M1 bytes are any byte.
    let byte = |r: &mut rand_chacha::ChaCha8Rng| -> u8 {
        let b: u8 = r.gen();
        if b & 0x7F == 0x7F {
            b & 0xF7
        } else {
            b
        }
    };
    let (q8, q4, qs, k8, k4, ks8, ks32);
    let inputs = if w.fp4 {
        q4 = ndarray::Array3::from_shape_fn((t, h, d / 2), |_| rng.gen::<u8>());
        qs = ndarray::Array3::from_shape_fn((t, h, g), |_| rng.gen_range(124u8..=130));
        k4 = ndarray::Array2::from_shape_fn((l, d / 2), |_| rng.gen::<u8>());
        ks8 = ndarray::Array2::from_shape_fn((l, g), |_| rng.gen_range(124u8..=130));
        Inputs {
            q: Queries::E2m1 {
                packed: q4.view(),
                scale: qs.view(),
            },
            k: Keys::E2m1 {
                packed: k4.view(),
                scale: ks8.view(),
            },
            weights: weights.view(),
            k_slots: None,
        }
    } else {
        q8 = ndarray::Array3::from_shape_fn((t, h, d), |_| byte(&mut rng));
        k8 = ndarray::Array2::from_shape_fn((l, d), |_| byte(&mut rng));
        ks32 = ndarray::Array1::from_shape_fn(l, |_| rng.gen_range(0.5f32..2.0));
        Inputs {
            q: Queries::E4m3(q8.view()),
            k: Keys::E4m3 {
                codes: k8.view(),
                scale: ks32.view(),
            },
            weights: weights.view(),
            k_slots: None,
        }
    };
    let role = match w.source_tail {
        Some(tail) => Role::Source { tail: Some(tail) },
        None => Role::Plain,
    };
    let p = Problem::new(&batch, inputs, Params::new(w.topk), role)?;
    let plan = crate::indexer::plan_for(b, &p, w.budget)?;
    b.begin(&p, &plan)?;
    let stream = b.dev.stream.clone();
    let ctx = b.dev.ctx.clone();
    let ev = || {
        ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(drv("create event"))
    };
    let (e0, e1) = (ev()?, ev()?);
    let mut total = Vec::new();
    let mut logits = Vec::new();
    let mut select = Vec::new();
    for rep in 0..=reps {
        let run = b.run.as_mut().ok_or_else(|| super::backend_err("no run"))?;
        // End to end.
        e0.record(&stream).map_err(drv("record"))?;
        for ti in 0..plan.tiles.len() {
            run.tile(&b.dev, ti)?;
        }
        e1.record(&stream).map_err(drv("record"))?;
        e1.synchronize().map_err(drv("synchronize"))?;
        let ms = e0.elapsed_ms(&e1).map_err(drv("elapsed"))? as f64;
        // The two halves, tile by tile.
        let (mut lm, mut sm) = (0f64, 0f64);
        for ti in 0..plan.tiles.len() {
            e0.record(&stream).map_err(drv("record"))?;
            run.logits_step(&b.dev, ti)?;
            e1.record(&stream).map_err(drv("record"))?;
            e1.synchronize().map_err(drv("synchronize"))?;
            lm += e0.elapsed_ms(&e1).map_err(drv("elapsed"))? as f64;
            e0.record(&stream).map_err(drv("record"))?;
            run.select_step(&b.dev, ti)?;
            e1.record(&stream).map_err(drv("record"))?;
            e1.synchronize().map_err(drv("synchronize"))?;
            sm += e0.elapsed_ms(&e1).map_err(drv("elapsed"))? as f64;
        }
        if rep > 0 {
            total.push(ms);
            logits.push(lm);
            select.push(sm);
        }
    }
    let measured_peak = b.peak;
    let mut out = crate::reference::Output::alloc(&p);
    b.end(&p, &mut out)?;
    // Each rep (and the warm-up) selects every tile twice: end to end, then halves.
    let runs = 2 * (reps as u64 + 1);
    let topk_paths = b.topk_paths().per_run(runs);
    let fold_counts = b.fold_counts().per_run(runs);
    let pairs = batch.valid_pairs() as f64;
    let flops = 2.0 * pairs * (h * d) as f64;
    let min_ms = total.iter().copied().fold(f64::INFINITY, f64::min);
    let (med, lmed, smed) = (median(total), median(logits), median(select));
    Ok(BenchResult {
        name: w.name.into(),
        device: b.dev.name(),
        rows: t,
        valid_pairs: pairs as u64,
        tiles: plan.tiles.len(),
        budget: w.budget,
        median_ms: med,
        min_ms,
        logits_ms: lmed,
        select_ms: smed,
        tflops: flops / (med * 1e-3) / 1e12,
        logits_tflops: flops / (lmed * 1e-3) / 1e12,
        topk_gbs: 4.0 * pairs / (smed * 1e-3) / 1e9,
        rows_per_s: t as f64 / (med * 1e-3),
        measured_peak,
        planned_peak: plan.peak.total(),
        reps,
        topk_paths,
        fold_counts,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The JSON line `dsa-indexer bench --device cuda --json` prints names every path
    /// counter, per run.
    #[test]
    fn json_has_the_path_counters_per_run() {
        let runs = 12;
        let r = BenchResult {
            name: "v32-16k".into(),
            device: "none".into(),
            rows: 1,
            valid_pairs: 1,
            tiles: 1,
            budget: 1,
            median_ms: 1.0,
            min_ms: 1.0,
            logits_ms: 1.0,
            select_ms: 1.0,
            tflops: 1.0,
            logits_tflops: 1.0,
            topk_gbs: 1.0,
            rows_per_s: 1.0,
            measured_peak: 1,
            planned_peak: 1,
            reps: 5,
            topk_paths: TopkPaths {
                all: 12,
                short: 24,
                sampled: 36,
                two_pass: 48,
                general: 60,
            }
            .per_run(runs),
            fold_counts: FoldCounts {
                query_blocks_folded: 120,
                query_blocks_plain: 0,
                threads_one_multiply: 1200,
                threads_two_multiplies: 12,
            }
            .per_run(runs),
        };
        let v: serde_json::Value = serde_json::from_str(&r.to_json()).unwrap();
        let p = &v["topk_paths"];
        let got = ["all", "short", "sampled", "two_pass", "general"].map(|k| p[k].as_u64());
        assert_eq!(got, [1, 2, 3, 4, 5].map(Some));
        let f = &v["fold_counts"];
        let got = [
            "query_blocks_folded",
            "query_blocks_plain",
            "threads_one_multiply",
            "threads_two_multiplies",
        ]
        .map(|k| f[k].as_u64());
        assert_eq!(got, [10, 0, 100, 1].map(Some));
    }
}
