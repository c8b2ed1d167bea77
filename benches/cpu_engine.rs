//! Criterion benches of the CPU path on a V4.1-shaped slice (fp4 x fp4, H=32, D=128):
//! 64 query rows at the end of a 16384-key request (about 1M (row, key) pairs).
//!
//! - `logits_e2m1_e2m1_h32_d128/{isa}`: the engine's logits alone, one thread, per ISA;
//!   throughput in (row, key) pairs; effective FLOP = 2 * pairs * H * D.
//! - `driver_topk512_h32_d128`: the chunked driver (logits + top-k + index assembly)
//!   on the default rayon pool.
//! - `logits_e4m3_e4m3_h64_d128/{isa}`: the tolerance class, V3.2-shaped (fp8 x fp8,
//!   H=64): 16 rows at the end of the same request, one thread.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use dsa_indexer::batch::Batch;
use dsa_indexer::cpu::{Engine, Isa, ROW_GROUP};
use dsa_indexer::problem::{Inputs, Keys, Params, Problem, Queries, Role};
use ndarray::{Array2, Array3};
use rand::{Rng, SeedableRng};

const KEYS: usize = 16384;
const ROWS: usize = 64;
const H: usize = 32;
const D: usize = 128;

struct Data {
    batch: Batch,
    q: Array3<u8>,
    qs: Array3<u8>,
    k: Array2<u8>,
    ks: Array2<u8>,
    w: Array2<f32>,
}

fn data() -> Data {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let batch = Batch::contiguous(&[KEYS], &[KEYS - ROWS], 1).unwrap();
    Data {
        q: Array3::from_shape_fn((ROWS, H, D / 2), |_| rng.gen()),
        qs: Array3::from_shape_fn((ROWS, H, D / 32), |_| rng.gen_range(120..=132)),
        k: Array2::from_shape_fn((KEYS, D / 2), |_| rng.gen()),
        ks: Array2::from_shape_fn((KEYS, D / 32), |_| rng.gen_range(120..=132)),
        w: Array2::from_shape_fn((ROWS, H), |_| rng.gen_range(-1.0f32..1.0)),
        batch,
    }
}

fn problem(d: &Data) -> Problem<'_> {
    let inputs = Inputs {
        q: Queries::E2m1 {
            packed: d.q.view(),
            scale: d.qs.view(),
        },
        k: Keys::E2m1 {
            packed: d.k.view(),
            scale: d.ks.view(),
        },
        weights: d.w.view(),
        k_slots: None,
    };
    Problem::new(&d.batch, inputs, Params::new(512), Role::Plain).unwrap()
}

fn bench(c: &mut Criterion) {
    let d = data();
    let p = problem(&d);
    let pairs = d.batch.valid_pairs();
    let rows = d.batch.rows();
    let mut buf = vec![0f32; pairs];
    let mut g = c.benchmark_group("logits_e2m1_e2m1_h32_d128");
    g.sample_size(10);
    g.throughput(Throughput::Elements(pairs as u64));
    for isa in Isa::available() {
        let mut e = Engine::with_isa(&p, isa);
        g.bench_with_input(BenchmarkId::from_parameter(isa.name()), &isa, |b, _| {
            b.iter(|| {
                let mut rest: &mut [f32] = &mut buf;
                for start in (0..ROWS).step_by(ROW_GROUP) {
                    let idx: Vec<usize> = (start..(start + ROW_GROUP).min(ROWS)).collect();
                    let mut outs: Vec<&mut [f32]> = Vec::with_capacity(idx.len());
                    for &i in &idx {
                        let (a, r) = std::mem::take(&mut rest).split_at_mut(rows[i].n);
                        outs.push(a);
                        rest = r;
                    }
                    e.rows(&p, &idx, &mut outs);
                }
            })
        });
    }
    g.finish();
    let mut g = c.benchmark_group("driver_topk512_h32_d128");
    g.sample_size(10);
    g.throughput(Throughput::Elements(pairs as u64));
    g.bench_function("cpu", |b| {
        b.iter(|| dsa_indexer::indexer::run_cpu(&p, dsa_indexer::plan::DEFAULT_BUDGET).unwrap())
    });
    g.finish();

    // Tolerance class: fp8 x fp8, H = 64 (V3.2).
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(8);
    let rows8 = 16;
    let batch8 = Batch::contiguous(&[KEYS], &[KEYS - rows8], 1).unwrap();
    let e4m3 = |rng: &mut rand_chacha::ChaCha8Rng| loop {
        let b: u8 = rng.gen();
        if b & 0x7F != 0x7F {
            return b;
        }
    };
    let q8 = Array3::from_shape_fn((rows8, 64, D), |_| e4m3(&mut rng));
    let k8 = Array2::from_shape_fn((KEYS, D), |_| e4m3(&mut rng));
    let k8s = ndarray::Array1::from_shape_fn(KEYS, |_| rng.gen_range(0.01f32..1.0));
    let w8 = Array2::from_shape_fn((rows8, 64), |_| rng.gen_range(-1.0f32..1.0));
    let inputs = Inputs {
        q: Queries::E4m3(q8.view()),
        k: Keys::E4m3 {
            codes: k8.view(),
            scale: k8s.view(),
        },
        weights: w8.view(),
        k_slots: None,
    };
    let p8 = Problem::new(&batch8, inputs, Params::new(2048), Role::Plain).unwrap();
    let pairs8 = batch8.valid_pairs();
    let rows8v = batch8.rows();
    let mut buf8 = vec![0f32; pairs8];
    let mut g = c.benchmark_group("logits_e4m3_e4m3_h64_d128");
    g.sample_size(10);
    g.throughput(Throughput::Elements(pairs8 as u64));
    for isa in Isa::available() {
        let mut e = Engine::with_isa(&p8, isa);
        g.bench_with_input(BenchmarkId::from_parameter(isa.name()), &isa, |b, _| {
            b.iter(|| {
                let mut rest: &mut [f32] = &mut buf8;
                for start in (0..rows8).step_by(ROW_GROUP) {
                    let idx: Vec<usize> = (start..(start + ROW_GROUP).min(rows8)).collect();
                    let mut outs: Vec<&mut [f32]> = Vec::with_capacity(idx.len());
                    for &i in &idx {
                        let (a, r) = std::mem::take(&mut rest).split_at_mut(rows8v[i].n);
                        outs.push(a);
                        rest = r;
                    }
                    e.rows(&p8, &idx, &mut outs);
                }
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
