//! `bench`: the driver's median time on a preset (any device), or the named GPU
//! workloads timed with CUDA events (`--device cuda WORKLOAD ...`).

use std::time::Instant;

use clap::Args;
use dsa_indexer::verdict::class_name;
use serde_json::json;

use crate::errors::{CliError, Result};
use crate::workload;
use crate::{checksum, parse_bytes, replay, Device, ShapeArgs};

#[derive(Args)]
pub struct BenchArgs {
    /// Named GPU workloads (v32-16k, v32-64k, v32-64k-tail, v41-chunk, v41-chunk-source,
    /// v41-chunk-wide, v41-1m, v41-1m-256m; decode over paged keys: v32-decode-b64-32k,
    /// v32-decode-b128-128k-mtp2, v32-decode-b1-128k, v41-decode-b64-64k; or `all`), timed with CUDA events;
    /// needs `--device cuda`. Without one, the preset runs.
    workloads: Vec<String>,
    #[command(flatten)]
    shape: ShapeArgs,
    /// Timed runs (after one warm-up run).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    #[arg(long, value_parser = parse_bytes, default_value = "2GiB")]
    budget: usize,
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    device: Device,
    /// Print JSON (named workloads: one line each).
    #[arg(long)]
    json: bool,
    /// A named workload, as a positional one.
    #[arg(long)]
    workload: Option<String>,
    /// The tolerance class's arithmetic on the GPU: `full` (SPEC 4's bound for every
    /// input, the default) or `fast` (E4M3 x E4M3 at H = 64 on fp8 wgmma, DeepGEMM's
    /// arithmetic, held to SPEC 4's fast-mode bound). Named workloads only.
    #[arg(long, default_value = "full")]
    precision: String,
}

/// `dsa-indexer bench`.
pub fn cmd_bench(a: &BenchArgs) -> Result<i32> {
    let names: Vec<String> = a.workload.iter().chain(&a.workloads).cloned().collect();
    if !names.is_empty() {
        if a.device != Device::Cuda {
            bail!(
                "workload {}: named workloads run on the GPU; add --device cuda",
                names.join(" ")
            );
        }
        return gpu::bench_workloads(&names, a.reps.max(1), a.json, &a.precision);
    }
    if a.precision != "full" {
        bail!(
            "--precision {}: the precision is a GPU mode of the named workloads",
            a.precision
        );
    }
    bench_preset(a)
}

/// One warm-up run, then `reps` timed runs of the driver on the preset.
fn bench_preset(a: &BenchArgs) -> Result<i32> {
    let shape = a.shape.shape()?;
    let dump = workload::synth(&shape, a.shape.seed)?;
    let batch = dump.batch()?;
    let published = dump.published_input(&batch);
    let p = dump.problem(&batch, published.as_ref())?;
    let _ = replay::run_driver(&p, a.device, a.budget, false)?; // warm-up
    let mut times = Vec::with_capacity(a.reps.max(1));
    let mut sum = 0;
    for _ in 0..a.reps.max(1) {
        let t0 = Instant::now();
        let out = replay::run_driver(&p, a.device, a.budget, false)?;
        times.push(t0.elapsed().as_secs_f64());
        sum = checksum(&out);
    }
    times.sort_by(|x, y| x.total_cmp(y));
    let med = times[times.len() / 2];
    let pairs = batch.valid_pairs();
    let flop = 2.0 * pairs as f64 * (p.heads * p.dim) as f64;
    if a.json {
        let j = json!({
            "preset": a.shape.preset, "device": a.device.name(),
            "isa": dsa_indexer::cpu::Isa::detect().name(),
            "threads": rayon::current_num_threads(),
            "rows": batch.num_rows(), "keys": batch.num_keys(), "valid_pairs": pairs,
            "heads": p.heads, "dim": p.dim, "topk": p.topk,
            "class": class_name(p.class()),
            "reps": times.len(), "median_seconds": med, "min_seconds": times[0],
            "tflops": flop / med / 1e12, "checksum": format!("{sum:016x}"),
        });
        println!("{}", serde_json::to_string_pretty(&j).unwrap_or_default());
    } else {
        println!(
            "bench {} on {}: {} rows, {} keys, {} pairs, H={} D={} K={}, {} class",
            a.shape.preset,
            a.device.describe(),
            batch.num_rows(),
            batch.num_keys(),
            pairs,
            p.heads,
            p.dim,
            p.topk,
            class_name(p.class())
        );
        println!(
            "  median {:.3} s over {} runs (min {:.3} s): {:.4} effective TFLOP/s (2 * pairs * H * D / t), {:.1} M pairs/s",
            med,
            times.len(),
            times[0],
            flop / med / 1e12,
            pairs as f64 / med / 1e6
        );
    }
    Ok(0)
}

#[cfg(feature = "cuda")]
mod gpu {
    use dsa_indexer::cuda::{bench, CudaBackend};
    use dsa_indexer::paged::PagedKeys;
    use dsa_indexer::problem::{Format, Inputs, Keys, Queries};
    use ndarray::{Array1, Array2, Array3};
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use super::{CliError, Result};
    use crate::workload;

    /// A workload's inputs, owned, from a fixed seed: fp4 queries and keys as the
    /// workload's [`bench::Fp4Draw`] says, fp8 codes uniform (away from NaN) with per-key
    /// scales in [0.5, 2), weights in [-1, 1). A decode workload's keys are drawn request
    /// by request into a page pool ([`workload::page_pool`]) instead of `k`.
    struct Data {
        weights: Array2<f32>,
        q: Array3<u8>,
        /// E2M1 queries' UE8M0 scales.
        qs: Array3<u8>,
        k: Array2<u8>,
        /// E2M1 keys' UE8M0 scales.
        ks: Array2<u8>,
        /// E4M3 keys' f32 scales.
        kscale: Array1<f32>,
        fp4: bool,
        /// A decode workload's keys.
        pool: Option<workload::PagePool>,
    }

    impl Data {
        fn new(w: &bench::Workload, t: usize, l: usize) -> Result<Data> {
            if let Some(d) = w.decode {
                return Data::decode(w, &d, t);
            }
            let mut rng = ChaCha8Rng::seed_from_u64(0x5eed);
            let (h, d) = (w.heads, w.dim);
            let g = d / 32;
            let weights = Array2::from_shape_fn((t, h), |_| rng.gen_range(-1.0f32..1.0));
            // E4M3 bytes away from the NaN codes.
            let byte = |r: &mut ChaCha8Rng| -> u8 {
                let b: u8 = r.gen();
                if b & 0x7F == 0x7F {
                    b & 0xF7
                } else {
                    b
                }
            };
            let none3 = || Array3::zeros((0, 0, 0));
            if w.fp4 {
                let ((q, qs), (k, ks)) = match w.fp4_draw {
                    bench::Fp4Draw::Quantized => {
                        let qc = workload::channel_exponents(h * d, &mut rng);
                        let kc = workload::channel_exponents(d, &mut rng);
                        let seed: u64 = rng.gen();
                        (
                            workload::engine_like_fp4(t * h, d, &qc, seed)?,
                            workload::engine_like_fp4(l, d, &kc, seed ^ 0x6b65_7973)?,
                        )
                    }
                    bench::Fp4Draw::UniformScales => (
                        workload::uniform_scale_fp4(t * h * d / 2, t * h * g, &mut rng),
                        workload::uniform_scale_fp4(l * d / 2, l * g, &mut rng),
                    ),
                };
                let shape = |e: ndarray::ShapeError| CliError::input(format!("bench inputs: {e}"));
                Ok(Data {
                    weights,
                    q: Array3::from_shape_vec((t, h, d / 2), q).map_err(shape)?,
                    qs: Array3::from_shape_vec((t, h, g), qs).map_err(shape)?,
                    k: Array2::from_shape_vec((l, d / 2), k).map_err(shape)?,
                    ks: Array2::from_shape_vec((l, g), ks).map_err(shape)?,
                    kscale: Array1::zeros(0),
                    fp4: true,
                    pool: None,
                })
            } else {
                let q = Array3::from_shape_fn((t, h, d), |_| byte(&mut rng));
                let k = Array2::from_shape_fn((l, d), |_| byte(&mut rng));
                let kscale = Array1::from_shape_fn(l, |_| rng.gen_range(0.5f32..2.0));
                Ok(Data {
                    weights,
                    q,
                    qs: none3(),
                    k,
                    ks: Array2::zeros((0, 0)),
                    kscale,
                    fp4: false,
                    pool: None,
                })
            }
        }

        /// A decode workload's inputs: weights and queries of its `t` rows drawn as
        /// [`Data::new`] draws them, then each request's `seq_len` keys (ratio 1) in the
        /// same way, into a pool of `page_size` pages in random order.
        fn decode(w: &bench::Workload, d: &bench::Decode, t: usize) -> Result<Data> {
            let mut rng = ChaCha8Rng::seed_from_u64(0x5eed);
            let (h, dim) = (w.heads, w.dim);
            let g = dim / 32;
            let lens = vec![w.seq_len; d.requests];
            let shape = |e: ndarray::ShapeError| CliError::input(format!("bench inputs: {e}"));
            let weights = Array2::from_shape_fn((t, h), |_| rng.gen_range(-1.0f32..1.0));
            let mut pool_rng = ChaCha8Rng::seed_from_u64(0x7061_6765);
            if w.fp4 {
                let (q, qs, kc, seed) = match w.fp4_draw {
                    bench::Fp4Draw::Quantized => {
                        let qc = workload::channel_exponents(h * dim, &mut rng);
                        let kc = workload::channel_exponents(dim, &mut rng);
                        let seed: u64 = rng.gen();
                        let (q, qs) = workload::engine_like_fp4(t * h, dim, &qc, seed)?;
                        (q, qs, Some(kc), seed)
                    }
                    bench::Fp4Draw::UniformScales => {
                        let (q, qs) =
                            workload::uniform_scale_fp4(t * h * dim / 2, t * h * g, &mut rng);
                        (q, qs, None, 0)
                    }
                };
                let pool = workload::page_pool(
                    w.key_format(),
                    dim,
                    d.page_size,
                    &lens,
                    &mut pool_rng,
                    |b| {
                        let (packed, scale) = match &kc {
                            // Request b's keys from their own seed, stream i for key i.
                            Some(kc) => workload::engine_like_fp4(
                                lens[b],
                                dim,
                                kc,
                                (seed ^ 0x6b65_7973).wrapping_add((b as u64 + 1) << 40),
                            )?,
                            None => workload::uniform_scale_fp4(
                                lens[b] * dim / 2,
                                lens[b] * g,
                                &mut rng,
                            ),
                        };
                        Ok(workload::FlatRun::E2m1 { packed, scale })
                    },
                )?;
                Ok(Data {
                    weights,
                    q: Array3::from_shape_vec((t, h, dim / 2), q).map_err(shape)?,
                    qs: Array3::from_shape_vec((t, h, g), qs).map_err(shape)?,
                    k: Array2::zeros((0, dim / 2)),
                    ks: Array2::zeros((0, g)),
                    kscale: Array1::zeros(0),
                    fp4: true,
                    pool: Some(pool),
                })
            } else {
                let byte = |r: &mut ChaCha8Rng| -> u8 {
                    let b: u8 = r.gen();
                    if b & 0x7F == 0x7F {
                        b & 0xF7
                    } else {
                        b
                    }
                };
                let q = Array3::from_shape_fn((t, h, dim), |_| byte(&mut rng));
                let pool = workload::page_pool(
                    w.key_format(),
                    dim,
                    d.page_size,
                    &lens,
                    &mut pool_rng,
                    |b| Ok(workload::e4m3_keys(lens[b], dim, &mut rng)),
                )?;
                Ok(Data {
                    weights,
                    q,
                    qs: Array3::zeros((0, 0, 0)),
                    k: Array2::zeros((0, dim)),
                    ks: Array2::zeros((0, 0)),
                    kscale: Array1::zeros(0),
                    fp4: false,
                    pool: Some(pool),
                })
            }
        }

        fn inputs(&self) -> Inputs<'_> {
            let (q, k) = if self.fp4 {
                (
                    Queries::E2m1 {
                        packed: self.q.view(),
                        scale: self.qs.view(),
                    },
                    Keys::E2m1 {
                        packed: self.k.view(),
                        scale: self.ks.view(),
                    },
                )
            } else {
                (
                    Queries::E4m3(self.q.view()),
                    Keys::E4m3 {
                        codes: self.k.view(),
                        scale: self.kscale.view(),
                    },
                )
            };
            let k = match &self.pool {
                Some(pool) => Keys::Paged(PagedKeys {
                    format: if self.fp4 { Format::E2m1 } else { Format::E4m3 },
                    kv_cache: pool.kv_cache.view(),
                    page_table: pool.page_table.view(),
                    page_size: pool.page_size,
                }),
                None => k,
            };
            Inputs {
                q,
                k,
                weights: self.weights.view(),
                k_slots: None,
            }
        }
    }

    /// Generate workload `w`'s inputs and time it.
    fn run_one(
        b: &mut CudaBackend,
        w: &bench::Workload,
        reps: usize,
    ) -> Result<bench::BenchResult> {
        let lib = |e| CliError::lib(w.name, e);
        let batch = w.batch().map_err(lib)?;
        let data = Data::new(w, batch.num_rows(), batch.num_keys())?;
        let p = w.problem(&batch, data.inputs()).map_err(lib)?;
        bench::run_workload(b, w, &p, reps).map_err(lib)
    }

    /// The named workloads (`all`: every one) on GPU 0, one after the other, each timed
    /// by the CUDA backend itself (CUDA events around all tiles; logits and selection
    /// split; counted and driver-level device memory). A workload that fails prints its error and the
    /// others still run; the exit code is the worst failure's.
    pub fn bench_workloads(
        names: &[String],
        reps: usize,
        json: bool,
        precision: &str,
    ) -> Result<i32> {
        let precision = dsa_indexer::cuda::Precision::parse(precision)?;
        let mut ws = Vec::new();
        for n in names {
            if n == "all" {
                ws.extend_from_slice(bench::WORKLOADS);
            } else {
                ws.push(bench::workload(n)?);
            }
        }
        let mut b = CudaBackend::new()?.with_precision(precision);
        let mut code = 0;
        for w in ws {
            match run_one(&mut b, &w, reps) {
                Ok(r) if json => println!("{}", r.to_json()),
                Ok(r) => print_text(&r),
                Err(e) => {
                    eprintln!("error: {}", e.msg);
                    code = code.max(e.code);
                }
            }
        }
        Ok(code)
    }

    fn print_text(r: &bench::BenchResult) {
        println!(
            "bench {} on {} ({} precision): {} rows, {} pairs, {} tiles, budget {} B",
            r.name, r.device, r.precision, r.rows, r.valid_pairs, r.tiles, r.budget
        );
        println!(
            "  median {:.3} ms over {} runs (min {:.3} ms): {:.1} effective TFLOP/s; logits {:.3} ms ({:.1} TFLOP/s), \
             selection {:.3} ms ({:.0} GB/s of logits)",
            r.median_ms, r.reps, r.min_ms, r.tflops, r.logits_ms, r.logits_tflops, r.select_ms, r.topk_gbs,
        );
        if let Some(d) = &r.decode {
            println!(
                "  decode: {} requests x {} rows, pages of {} ({} in the pool, {} B a token); KV floor \
                 {} B read at {:.0} GB/s end to end, {:.1} % of the {:.0} GB/s copy ceiling",
                d.requests,
                d.next_n,
                d.page_size,
                d.pool_pages,
                d.bytes_per_token,
                d.kv_bytes,
                d.kv_gbs,
                100.0 * d.kv_ceiling_fraction,
                bench::KV_COPY_CEILING_GBS
            );
        }
        let m = &r.driver;
        println!(
            "  device memory: counted transient {} B (planned peak {} B); driver (cuMemGetInfo) \
             {} B in use before, high-water {} B over {} readings (+{} B), {} B after",
            r.counted_peak,
            r.planned_peak,
            m.before,
            m.high,
            m.samples,
            m.peak(),
            m.after
        );
        let (p, f) = (&r.topk_paths, &r.fold_counts);
        println!(
            "  per run: top-k rows all {} short {} sampled {} resampled {} two-pass {} general {}; \
             exact-class query blocks folded {} plain {}, threads one multiply {} two {}, int8 tiles \
             {} fallback {}",
            p.all, p.short, p.sampled, p.resampled, p.two_pass, p.general, f.query_blocks_folded,
            f.query_blocks_plain, f.threads_one_multiply, f.threads_two_multiplies, f.tiles_int8,
            f.tiles_int8_fallback
        );
    }

    /// The decode inputs on the host (no GPU): a small decode workload of either format
    /// gives a valid paged problem over a pool of exactly the pages used.
    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn decode_inputs_make_a_valid_paged_problem() {
            for name in ["v32-decode-b64-32k", "v41-decode-b64-64k"] {
                let w = bench::Workload {
                    seq_len: 130,
                    rows: 2,
                    decode: Some(bench::Decode {
                        requests: 3,
                        page_size: 64,
                    }),
                    ..bench::workload(name).unwrap()
                };
                let batch = w.batch().unwrap();
                let data = Data::new(&w, batch.num_rows(), batch.num_keys()).unwrap();
                let p = w.problem(&batch, data.inputs()).unwrap();
                let pk = p.paged().expect("paged keys");
                assert_eq!(pk.num_pages(), 3 * 3, "{name}");
                assert_eq!(pk.format, w.key_format());
                assert_eq!((p.heads, p.topk, batch.num_rows()), (w.heads, w.topk, 6));
            }
        }
    }
}

#[cfg(not(feature = "cuda"))]
mod gpu {
    use super::{CliError, Result};

    pub fn bench_workloads(
        names: &[String],
        _reps: usize,
        _json: bool,
        _precision: &str,
    ) -> Result<i32> {
        Err(CliError::environment(format!(
            "workload {}: built without the cuda feature (cargo build --release --features cuda)",
            names.join(" ")
        )))
    }
}
