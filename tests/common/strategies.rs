//! proptest strategies: random ragged batches (prefix hits, replayed rows, empty
//! requests, explicit rows: interleaved, or drawn with duplicates and gaps), all format
//! pairs, the three roles (a consumer takes what a source over its batch publishes), and
//! the layer parameters.
//! A case is an owned [`Dump`], so that failing cases can be written out and replayed.

use dsa_indexer::batch::Batch;
use dsa_indexer::dump::{Dump, Expected, KData, Layout, Meta, QData, RoleKind};
use dsa_indexer::problem::{Format, Published};
use dsa_indexer::reference;
use ndarray::{Array1, Array2, Array3};
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Shape of a random case.
#[derive(Debug, Clone)]
pub struct Shape {
    pub seq_lens: Vec<usize>,
    pub query_starts: Vec<usize>,
    pub explicit: bool,
    /// Explicit rows drawn at any position of their request, with repeats: duplicate
    /// rows, and positions left out between them (else each row of `q0..S` once).
    pub repeats: bool,
    pub ratio: usize,
    pub heads: usize,
    pub dim: usize,
    pub q_format: Format,
    pub k_format: Format,
    pub topk: usize,
    pub block_size: usize,
    pub num_blocks: usize,
    pub role: RoleKind,
    pub tail: Option<usize>,
    /// Small value alphabets make exact ties and repeated keys common.
    pub narrow: bool,
    pub seed: u64,
}

pub fn format() -> impl Strategy<Value = Format> {
    prop_oneof![Just(Format::E2m1), Just(Format::E4m3)]
}

/// Requests: `(seq_len, query_start)` with prefix hits, cold prompts and empty requests.
pub fn requests(max_seq: usize) -> impl Strategy<Value = Vec<(usize, usize)>> {
    prop::collection::vec(
        (0..=max_seq).prop_flat_map(|s| {
            prop_oneof![
                2 => Just((s, 0)),          // cold prefill
                3 => (0..=s).prop_map(move |q0| (s, q0)), // prefix hit / replay
                1 => Just((s, s)),          // no rows
            ]
        }),
        1..4,
    )
}

pub fn shape_with(max_seq: usize, heads: Vec<usize>) -> impl Strategy<Value = Shape> {
    (
        requests(max_seq),
        any::<bool>(),
        prop::sample::select(vec![1usize, 2, 4]),
        prop::sample::select(heads),
        prop::sample::select(vec![32usize, 64, 128]),
        format(),
        format(),
        1usize..12,
        1usize..5,
        1usize..5,
        (
            0usize..3,
            prop::option::of(1usize..6),
            any::<bool>(),
            any::<u64>(),
            any::<bool>(),
        ),
    )
        .prop_map(
            |(
                reqs,
                explicit,
                ratio,
                heads,
                dim,
                qf,
                kf,
                topk,
                b,
                nb,
                (role, tail, narrow, seed, repeats),
            )| Shape {
                seq_lens: reqs.iter().map(|r| r.0).collect(),
                query_starts: reqs.iter().map(|r| r.1).collect(),
                explicit,
                repeats,
                ratio,
                heads,
                dim,
                q_format: qf,
                k_format: kf,
                topk,
                block_size: b,
                num_blocks: nb,
                role: [RoleKind::Plain, RoleKind::Source, RoleKind::Consumer][role],
                tail,
                narrow,
                seed,
            },
        )
}

/// Small random shapes: every feature, cheap enough for many cases.
pub fn shape() -> impl Strategy<Value = Shape> {
    shape_with(40, vec![8, 8, 16, 32, 64])
}

fn e4m3_byte(rng: &mut ChaCha8Rng, narrow: bool) -> u8 {
    if narrow {
        // {0, ±0.5, ±1, ±2}
        [0x00u8, 0x30, 0x38, 0x40, 0xB0, 0xB8, 0xC0][rng.gen_range(0..7)]
    } else {
        loop {
            let b: u8 = rng.gen();
            if b & 0x7F != 0x7F {
                return b;
            }
        }
    }
}

fn nibble_pair(rng: &mut ChaCha8Rng, narrow: bool) -> u8 {
    if narrow {
        let n = |r: &mut ChaCha8Rng| [0u8, 2, 4, 10, 12][r.gen_range(0..5)];
        n(rng) | (n(rng) << 4)
    } else {
        rng.gen()
    }
}

fn scale_byte(rng: &mut ChaCha8Rng, narrow: bool) -> u8 {
    if narrow {
        127
    } else {
        rng.gen_range(118..=136)
    }
}

/// Build the case's inputs (no expected outputs; the reference is the oracle).
pub fn build(s: &Shape) -> Dump {
    let mut rng = ChaCha8Rng::seed_from_u64(s.seed);
    let (h, d) = (s.heads, s.dim);
    let g = d / 32;
    let rows: Vec<(usize, usize)> = if s.explicit && s.repeats {
        // As many rows as the contiguous layout has, each at a random position of its
        // request: duplicates, and gaps between the positions drawn.
        let mut rows = Vec::new();
        for (b, (&sl, &q0)) in s.seq_lens.iter().zip(&s.query_starts).enumerate() {
            if sl > 0 {
                rows.extend((q0..sl).map(|_| (b, rng.gen_range(0..sl))));
            }
        }
        rows
    } else {
        s.seq_lens
            .iter()
            .zip(&s.query_starts)
            .enumerate()
            .flat_map(|(b, (&sl, &q0))| (q0..sl).map(move |p| (b, p)))
            .collect()
    };
    let layout = if s.explicit {
        // Interleave the rows of all requests, like a context-parallel rank.
        let mut rows = rows.clone();
        for i in (1..rows.len()).rev() {
            let j = rng.gen_range(0..=i);
            rows.swap(i, j);
        }
        Layout::Explicit {
            requests: rows.iter().map(|r| r.0).collect(),
            positions: rows.iter().map(|r| r.1).collect(),
        }
    } else {
        Layout::Contiguous(s.query_starts.clone())
    };
    let t = rows.len();
    let l: usize = s.seq_lens.iter().map(|&x| x / s.ratio).sum();
    let q = match s.q_format {
        Format::E4m3 => QData::E4m3(Array3::from_shape_fn((t, h, d), |_| {
            e4m3_byte(&mut rng, s.narrow)
        })),
        Format::E2m1 => QData::E2m1 {
            packed: Array3::from_shape_fn((t, h, d / 2), |_| nibble_pair(&mut rng, s.narrow)),
            scale: Array3::from_shape_fn((t, h, g), |_| scale_byte(&mut rng, s.narrow)),
        },
    };
    // Keys: some repeated rows (exact ties).
    let k = match s.k_format {
        Format::E4m3 => KData::E4m3 {
            codes: Array2::from_shape_fn((l, d), |_| e4m3_byte(&mut rng, s.narrow)),
            scale: Array1::from_shape_fn(l, |_| {
                if s.narrow {
                    1.0
                } else {
                    rng.gen_range(0.01f32..2.0)
                }
            }),
        },
        Format::E2m1 => KData::E2m1 {
            packed: Array2::from_shape_fn((l, d / 2), |_| nibble_pair(&mut rng, s.narrow)),
            scale: Array2::from_shape_fn((l, g), |_| scale_byte(&mut rng, s.narrow)),
        },
    };
    let weights = Array2::from_shape_fn((t, h), |_| {
        if s.narrow {
            [1.0f32, -1.0, 0.5][rng.gen_range(0..3)]
        } else {
            rng.gen_range(-1.0f32..1.0)
        }
    });
    let k_slots = rng
        .gen_bool(0.5)
        .then(|| Array1::from_shape_fn(l, |_| rng.gen_range(0..1_000_000)));
    let mut dump = Dump {
        meta: Meta {
            heads: h,
            dim: d,
            topk: s.topk,
            ratio: s.ratio,
            q_format: s.q_format,
            k_format: s.k_format,
            role: s.role,
            block_size: s.block_size,
            num_blocks: s.num_blocks,
            page_cols: None,
            tail: if s.role == RoleKind::Source {
                s.tail
            } else {
                None
            },
            next_n: None,
            description: String::new(),
        },
        seq_lens: s.seq_lens.clone(),
        layout,
        q,
        k,
        weights,
        k_slots,
        candidates: None,
        engine_logits: None,
        expected: Expected::default(),
    };
    if s.role == RoleKind::Consumer {
        // The candidates a source over the same batch publishes, row for row.
        let mut src = dump.clone();
        src.meta.role = RoleKind::Source;
        let batch = src.batch().expect("a strategy's batch is valid");
        let p = src
            .problem(&batch, None)
            .expect("a strategy's source is valid");
        let published = reference::run(&p).published.expect("a source publishes");
        dump.candidates = Some(published.blocks);
    }
    dump
}

/// The batch of `d` and a consumer's candidates for it (`None` for the other roles).
pub fn batch_and_candidates(d: &Dump) -> (Batch, Option<Published>) {
    let batch = d.batch().expect("a strategy's batch is valid");
    let published = d.published_input(&batch);
    (batch, published)
}

pub fn case() -> impl Strategy<Value = Dump> {
    shape().prop_map(|s| build(&s))
}

/// The inputs of `d` restricted to rows `rows` (in order), owned: a consumer's
/// queries and weights are the source's at its published rows.
pub fn sub_rows(d: &Dump, rows: &[usize]) -> Dump {
    use ndarray::Axis;
    let mut out = d.clone();
    out.q = match &d.q {
        QData::E4m3(q) => QData::E4m3(q.select(Axis(0), rows)),
        QData::E2m1 { packed, scale } => QData::E2m1 {
            packed: packed.select(Axis(0), rows),
            scale: scale.select(Axis(0), rows),
        },
    };
    out.weights = d.weights.select(Axis(0), rows);
    out
}

impl Shape {
    /// A fixed fp4 x fp4 plain layer over the given requests (ratio 1, H = 8, D = 32,
    /// K = 4, B = 8, NB = 2048, contiguous rows, seed 0): the base that fixed test
    /// cases change with struct-update syntax.
    pub fn fp4(seq_lens: Vec<usize>, query_starts: Vec<usize>) -> Shape {
        Shape {
            seq_lens,
            query_starts,
            explicit: false,
            repeats: false,
            ratio: 1,
            heads: 8,
            dim: 32,
            q_format: Format::E2m1,
            k_format: Format::E2m1,
            topk: 4,
            block_size: 8,
            num_blocks: 2048,
            role: RoleKind::Plain,
            tail: None,
            narrow: false,
            seed: 0,
        }
    }
}
