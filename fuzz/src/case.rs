//! One structured layer-forward, built from fuzzer bytes so that most inputs pass
//! validation: a small ragged batch (contiguous or explicit rows, prefix hits, empty
//! requests), every format pair, small value palettes (ties), arbitrary f32 weights and
//! key scales (overflow to infinity, NaN logits), the three roles with tails, small
//! `B` and `NB`, two budgets and a thread count. When its first byte says so (a
//! quarter of random bytes; about 13 % of what libFuzzer feeds it), an input carries one
//! deliberate defect (a NaN code, scale byte 255, a zero parameter, a bad consumer
//! row...), and then the crate must answer with its error type.

use arbitrary::Arbitrary;
use ndarray::{Array1, Array2, Array3};

use dsa_indexer::batch::Batch;
use dsa_indexer::plan::Plan;
use dsa_indexer::problem::{Inputs, Keys, Params, Problem, Queries, Role};
use dsa_indexer::reference::{self, Output};
use dsa_indexer::Result;

use crate::{kind, Rng, STATS};

/// The fuzzer's view of a case. Every field has a fixed size, so the byte layout is
/// simply the fields in order (integers and `f32` little-endian, `bool` and `Option`
/// tags one byte, low bit set = true), missing bytes read as zero, and
/// [`Spec::to_bytes`] writes seeds. Lengths and selectors are taken modulo their range.
#[derive(Arbitrary, Debug, Clone, Default, PartialEq)]
pub struct Spec {
    /// `corrupt % 64 >= 48` injects defect number `corrupt % 64 - 48` (0, the
    /// fuzzer's default for a short input, injects none).
    pub corrupt: u8,
    /// `r = 1 + ratio % 4`.
    pub ratio: u8,
    /// Requests used: `[2, 1, 3, 4, 0][n_requests % 5]`.
    pub n_requests: u8,
    /// `(seq_len, rows)` per request: `S = a % 41`, `E = b % (S + 1)`, `q0 = S - E`.
    pub requests: [(u8, u8); 4],
    /// Odd: explicit rows, drawn from `seed` (duplicates and any order).
    pub explicit: u8,
    /// Explicit rows: `n_explicit % 49`.
    pub n_explicit: u8,
    /// `H` selector (small values likelier).
    pub heads: u8,
    /// `D` selector.
    pub dim: u8,
    /// Queries in E2M1 (else E4M3).
    pub q_fp4: bool,
    /// Keys in E2M1 (else E4M3).
    pub k_fp4: bool,
    /// Query code bytes come from the first `len % 9` entries (all bytes when 0).
    pub q_palette: (u8, [u8; 8]),
    /// Key code bytes.
    pub k_palette: (u8, [u8; 8]),
    /// UE8M0 scale bytes (`110..=145` when empty; 255 becomes 254).
    pub scale_palette: (u8, [u8; 8]),
    /// Head weights (non-finite ones become 0.5; quarter-steps in [-2, 2] when empty).
    pub w_palette: (u8, [f32; 4]),
    /// Per-key scales (absolute value; non-finite or zero become 1).
    pub kscale_palette: (u8, [f32; 4]),
    /// Fills the tensors.
    pub seed: u64,
    /// Give `k_slots` (else the identity).
    pub slots: bool,
    /// `K = 1 + topk % 48`.
    pub topk: u8,
    /// `page_cols = K + extra` when present.
    pub page_extra: Option<u8>,
    /// `B = 1 + b % 9`.
    pub block_size: u8,
    /// `NB = 1 + nb % 6`.
    pub num_blocks: u8,
    /// `role % 3`: plain, source, consumer (of a source run on the same batch).
    pub role: u8,
    /// `tail = 1 + t % 40`.
    pub tail: Option<u8>,
    /// Two logits budgets in bytes (0, the fuzzer's default, means `usize::MAX`).
    pub budgets: [u16; 2],
    /// Rayon threads: `1 + threads % 3`.
    pub threads: u8,
}

/// The first `len % (N + 1)` entries of a palette.
fn used<T, const N: usize>(p: &(u8, [T; N])) -> &[T] {
    &p.1[..p.0 as usize % (N + 1)]
}

/// Owned inputs of one problem.
#[derive(Debug, Clone)]
pub struct Owned {
    /// E4M3 queries `[T, H, D]` or packed E2M1 `[T, H, D/2]`.
    pub q: Array3<u8>,
    /// UE8M0 query scales `[T, H, D/32]` (fp4 queries).
    pub q_scale: Option<Array3<u8>>,
    /// Weights `[T', H]`.
    pub w: Array2<f32>,
}

/// Keys shared by a source and its consumer.
#[derive(Debug, Clone)]
pub struct OwnedKeys {
    /// E4M3 `[L, D]` or packed E2M1 `[L, D/2]`.
    pub k: Array2<u8>,
    /// UE8M0 `[L, D/32]` (fp4 keys).
    pub k_scale: Option<Array2<u8>>,
    /// f32 `[L]` (E4M3 keys).
    pub kscale: Option<Array1<f32>>,
    /// `k_slots [L]`.
    pub slots: Option<Array1<i32>>,
}

/// The defects a case may carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Defect {
    /// An E4M3 NaN code in q or k.
    NanCode,
    /// UE8M0 byte 255.
    Scale255,
    /// A non-finite weight.
    BadWeight,
    /// A key scale that is not finite and positive.
    BadKscale,
    /// A negative slot.
    NegativeSlot,
    /// Weights with one row too many.
    WeightsShape,
    /// `K = 0`.
    ZeroTopk,
    /// `page_cols = K - 1`.
    NarrowPage,
    /// `B = 0`.
    ZeroBlock,
    /// `NB = 0`.
    ZeroBlocks,
    /// `tail = 0`.
    ZeroTail,
    /// Budget 0.
    ZeroBudget,
    /// Ratio 0.
    ZeroRatio,
    /// `query_start > seq_len`, or an explicit position `>= seq_len`.
    RowOutOfRange,
    /// A consumer block id out of range.
    BadCandidate,
    /// A consumer missing its last row.
    MissingCandidateRow,
}

const DEFECTS: [Defect; 16] = [
    Defect::NanCode,
    Defect::Scale255,
    Defect::BadWeight,
    Defect::BadKscale,
    Defect::NegativeSlot,
    Defect::WeightsShape,
    Defect::ZeroTopk,
    Defect::NarrowPage,
    Defect::ZeroBlock,
    Defect::ZeroBlocks,
    Defect::ZeroTail,
    Defect::ZeroBudget,
    Defect::ZeroRatio,
    Defect::RowOutOfRange,
    Defect::BadCandidate,
    Defect::MissingCandidateRow,
];

/// Largest rows in a case, and the cost cap `sum n * H * D`.
pub const MAX_ROWS: usize = 48;
const MAX_COST: usize = 1 << 20;

/// Shape decisions of a case.
#[derive(Debug, Clone)]
pub struct Layout {
    /// `S_b`.
    pub seq_lens: Vec<usize>,
    /// `q0_b` (contiguous).
    pub query_starts: Vec<usize>,
    /// Explicit rows.
    pub explicit: Option<(Vec<usize>, Vec<usize>)>,
    /// `r` (0 under [`Defect::ZeroRatio`]).
    pub ratio: usize,
    /// `H`.
    pub heads: usize,
    /// `D`.
    pub dim: usize,
}

impl Spec {
    /// The bytes that decode to this spec (for seed corpora and regression files).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = vec![self.corrupt, self.ratio, self.n_requests];
        for &(x, y) in &self.requests {
            b.extend([x, y]);
        }
        b.extend([
            self.explicit,
            self.n_explicit,
            self.heads,
            self.dim,
            self.q_fp4 as u8,
            self.k_fp4 as u8,
        ]);
        for p in [&self.q_palette, &self.k_palette, &self.scale_palette] {
            b.push(p.0);
            b.extend(p.1);
        }
        for p in [&self.w_palette, &self.kscale_palette] {
            b.push(p.0);
            p.1.iter().for_each(|x| b.extend(x.to_le_bytes()));
        }
        b.extend(self.seed.to_le_bytes());
        b.extend([self.slots as u8, self.topk]);
        let opt = |b: &mut Vec<u8>, x: Option<u8>| match x {
            Some(v) => b.extend([1, v]),
            None => b.push(0),
        };
        opt(&mut b, self.page_extra);
        b.extend([self.block_size, self.num_blocks, self.role]);
        opt(&mut b, self.tail);
        self.budgets.iter().for_each(|x| b.extend(x.to_le_bytes()));
        b.push(self.threads);
        b
    }

    /// The defect this case carries, if any.
    pub fn defect(&self) -> Option<Defect> {
        ((self.corrupt % 64) as usize)
            .checked_sub(48)
            .and_then(|i| DEFECTS.get(i).copied())
    }

    /// Requests, rows, `H`, `D`.
    pub fn layout(&self) -> Layout {
        let ratio = 1 + (self.ratio % 4) as usize;
        let mut seq_lens = Vec::new();
        let mut query_starts = Vec::new();
        let mut rows = 0usize;
        let n = [2, 1, 3, 4, 0][(self.n_requests % 5) as usize];
        for &(a, b) in &self.requests[..n] {
            let s = (a % 41) as usize;
            let e = ((b as usize) % (s + 1)).min(MAX_ROWS - rows);
            rows += e;
            seq_lens.push(s);
            query_starts.push(s - e);
        }
        let live: Vec<usize> = (0..seq_lens.len()).filter(|&b| seq_lens[b] > 0).collect();
        let explicit: Option<(Vec<usize>, Vec<usize>)> =
            (self.explicit % 2 == 1 && !live.is_empty()).then(|| {
                let mut rng = Rng(self.seed ^ 0x5EED);
                (0..self.n_explicit as usize % (MAX_ROWS + 1))
                    .map(|_| {
                        let b = live[rng.below(live.len())];
                        (b, rng.below(seq_lens[b]))
                    })
                    .unzip()
            });
        let mut heads = [8, 8, 8, 8, 16, 16, 32, 64][(self.heads % 8) as usize];
        let mut dim = [32, 32, 64, 128][(self.dim % 4) as usize];
        // Bound the reference's work: sum n * H * D.
        let pairs: usize = match &explicit {
            Some((_, pos)) => pos.iter().map(|p| (p + 1) / ratio).sum(),
            None => seq_lens
                .iter()
                .zip(&query_starts)
                .map(|(&s, &q0)| (q0..s).map(|p| (p + 1) / ratio).sum::<usize>())
                .sum(),
        };
        while pairs * heads * dim > MAX_COST && heads > 8 {
            heads /= 2;
        }
        while pairs * heads * dim > MAX_COST && dim > 32 {
            dim /= 2;
        }
        Layout {
            seq_lens,
            query_starts,
            explicit,
            ratio,
            heads,
            dim,
        }
    }

    /// `K`, `page_cols`, `B`, `NB`.
    pub fn params(&self) -> Params {
        let topk = 1 + (self.topk % 48) as usize;
        Params {
            topk,
            page_cols: self.page_extra.map(|e| topk + e as usize),
            block_size: 1 + (self.block_size % 9) as usize,
            num_blocks: 1 + (self.num_blocks % 6) as usize,
        }
    }

    /// `tail`.
    pub fn tail(&self) -> Option<usize> {
        self.tail.map(|t| 1 + (t % 40) as usize)
    }

    /// The two budgets.
    pub fn budgets(&self) -> [usize; 2] {
        self.budgets
            .map(|b| if b == 0 { usize::MAX } else { b as usize })
    }

    fn e4m3(&self, rng: &mut Rng, palette: &(u8, [u8; 8])) -> u8 {
        let palette = used(palette);
        let b = rng.pick(palette, |r| r.next() as u8);
        if b & 0x7F == 0x7F {
            b ^ 1
        } else {
            b
        }
    }

    fn packed(&self, rng: &mut Rng, palette: &(u8, [u8; 8])) -> u8 {
        rng.pick(used(palette), |r| r.next() as u8)
    }

    fn scale(&self, rng: &mut Rng) -> u8 {
        let p = used(&self.scale_palette);
        let b = rng.pick(p, |r| 110 + r.below(36) as u8);
        b.min(254)
    }

    fn weight(&self, rng: &mut Rng) -> f32 {
        let p = used(&self.w_palette);
        let w = rng.pick(p, |r| (r.below(17) as f32 - 8.0) * 0.25);
        if w.is_finite() {
            w
        } else {
            0.5
        }
    }

    fn kscale(&self, rng: &mut Rng) -> f32 {
        let p = used(&self.kscale_palette);
        let s = rng.pick(p, |r| (1 + r.below(8)) as f32 * 0.125).abs();
        if s.is_finite() && s > 0.0 {
            s
        } else {
            1.0
        }
    }

    /// Queries and weights for `t` rows.
    pub fn queries(&self, rng: &mut Rng, t: usize, h: usize, d: usize) -> Owned {
        let (q, q_scale) = if self.q_fp4 {
            (
                Array3::from_shape_simple_fn((t, h, d / 2), || self.packed(rng, &self.q_palette)),
                Some(Array3::from_shape_simple_fn((t, h, d / 32), || {
                    self.scale(rng)
                })),
            )
        } else {
            (
                Array3::from_shape_simple_fn((t, h, d), || self.e4m3(rng, &self.q_palette)),
                None,
            )
        };
        let w = Array2::from_shape_simple_fn((t, h), || self.weight(rng));
        Owned { q, q_scale, w }
    }

    /// Keys for `l` flat keys.
    pub fn keys(&self, rng: &mut Rng, l: usize, d: usize) -> OwnedKeys {
        let (k, k_scale, kscale) = if self.k_fp4 {
            (
                Array2::from_shape_simple_fn((l, d / 2), || self.packed(rng, &self.k_palette)),
                Some(Array2::from_shape_simple_fn((l, d / 32), || {
                    self.scale(rng)
                })),
                None,
            )
        } else {
            (
                Array2::from_shape_simple_fn((l, d), || self.e4m3(rng, &self.k_palette)),
                None,
                Some(Array1::from_shape_simple_fn(l, || self.kscale(rng))),
            )
        };
        let slots = self
            .slots
            .then(|| Array1::from_shape_simple_fn(l, || rng.below(1 << 20) as i32));
        OwnedKeys {
            k,
            k_scale,
            kscale,
            slots,
        }
    }
}

/// Views of owned inputs.
pub fn inputs<'a>(q: &'a Owned, k: &'a OwnedKeys) -> Inputs<'a> {
    Inputs {
        q: match &q.q_scale {
            Some(s) => Queries::E2m1 {
                packed: q.q.view(),
                scale: s.view(),
            },
            None => Queries::E4m3(q.q.view()),
        },
        k: match (&k.k_scale, &k.kscale) {
            (Some(s), _) => Keys::E2m1 {
                packed: k.k.view(),
                scale: s.view(),
            },
            (None, Some(s)) => Keys::E4m3 {
                codes: k.k.view(),
                scale: s.view(),
            },
            (None, None) => unreachable!("keys have one scale form"),
        },
        weights: q.w.view(),
        k_slots: k.slots.as_ref().map(|s| s.view()),
    }
}

/// Apply an input defect; returns whether it took effect (a non-empty tensor was hit).
fn corrupt_inputs(d: Defect, rng: &mut Rng, q: &mut Owned, k: &mut OwnedKeys) -> bool {
    fn hit<T: Copy>(a: &mut [T], v: T, rng: &mut Rng) -> bool {
        if a.is_empty() {
            return false;
        }
        let i = rng.below(a.len());
        a[i] = v;
        true
    }
    match d {
        Defect::NanCode => {
            let nan = if rng.next() & 1 == 0 { 0x7F } else { 0xFF };
            let qhit = q.q_scale.is_none() && hit(q.q.as_slice_mut().unwrap(), nan, rng);
            let khit = k.kscale.is_some() && hit(k.k.as_slice_mut().unwrap(), nan, rng);
            qhit || khit
        }
        Defect::Scale255 => {
            let qhit = q
                .q_scale
                .as_mut()
                .is_some_and(|a| hit(a.as_slice_mut().unwrap(), 255, rng));
            let khit = k
                .k_scale
                .as_mut()
                .is_some_and(|a| hit(a.as_slice_mut().unwrap(), 255, rng));
            qhit || khit
        }
        Defect::BadWeight => {
            let v = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][rng.below(3)];
            hit(q.w.as_slice_mut().unwrap(), v, rng)
        }
        Defect::BadKscale => {
            let v = [f32::NAN, f32::INFINITY, 0.0, -0.0, -1.0][rng.below(5)];
            k.kscale
                .as_mut()
                .is_some_and(|a| hit(a.as_slice_mut().unwrap(), v, rng))
        }
        Defect::NegativeSlot => {
            let l = k.k.nrows();
            let mut slots = k
                .slots
                .take()
                .unwrap_or_else(|| Array1::from_shape_fn(l, |x| x as i32));
            let v = -1 - rng.below(1 << 30) as i32;
            let took = hit(slots.as_slice_mut().unwrap(), v, rng);
            k.slots = Some(slots);
            took
        }
        Defect::WeightsShape => {
            let (t, h) = q.w.dim();
            q.w = Array2::from_elem((t + 1, h), 1.0);
            true
        }
        _ => false,
    }
}

/// What a backend run returns.
pub type BackendRun = Result<(Output, Plan)>;

/// A backend under test.
pub trait Subject {
    /// The chunked driver on this backend under `budget` (`threads`: a hint for CPU pools).
    fn run(&mut self, p: &Problem, budget: usize, threads: u8) -> BackendRun;
    /// The backend's logits as it computes them under `budget`, rows concatenated
    /// (the layout of `reference::logits`), once per variant (an ISA, a device).
    fn logits(
        &mut self,
        p: &Problem,
        budget: usize,
        threads: u8,
    ) -> Vec<(String, Result<Vec<f32>>)>;
    /// `None`: logits are held bitwise. `Some(b)`: logit `[i, j]` within
    /// `b(p, i, j, M)` of the reference's (SPEC 4's `M`, from [`magnitude`]), and the
    /// outputs must then be the reference's selection from the backend's logits.
    fn bound(&self, p: &Problem) -> Option<LogitBound>;
}

/// A backend's stated bound on `|x - ref|` for logit `[i, j]` of a problem, given that
/// logit's SPEC 4 magnitude `M` (e.g. `dsa_indexer::cuda::logit_bound`).
pub type LogitBound = fn(&Problem, usize, usize, f64) -> f64;

/// The CPU backend: driver on a pool of `1 + threads % 3` rayon threads, logits of
/// every instruction set this CPU has, all bitwise.
#[derive(Debug, Default)]
pub struct Cpu;

impl Subject for Cpu {
    fn run(&mut self, p: &Problem, budget: usize, threads: u8) -> BackendRun {
        on_pool(threads, || dsa_indexer::indexer::run_cpu(p, budget))
    }
    fn logits(
        &mut self,
        p: &Problem,
        _budget: usize,
        threads: u8,
    ) -> Vec<(String, Result<Vec<f32>>)> {
        dsa_indexer::cpu::Isa::available()
            .into_iter()
            .map(|isa| {
                let l = on_pool(threads, || dsa_indexer::cpu::engine_logits(p, isa));
                (isa.name().to_string(), Ok(l))
            })
            .collect()
    }
    fn bound(&self, _p: &Problem) -> Option<LogitBound> {
        None
    }
}

/// Build the case, run the reference and `backend` (under each budget), compare.
/// Panics on any disagreement, on a valid case the crate rejects, and on a defect it
/// accepts. Counts the outcome in [`STATS`].
pub fn check(spec: &Spec, backend: &mut dyn Subject) {
    let defect = spec.defect();
    let mut rng = Rng(spec.seed);
    let mut lay = spec.layout();
    let mut expect_err = false;
    if defect == Some(Defect::ZeroRatio) {
        lay.ratio = 0;
        expect_err = true;
    }
    if defect == Some(Defect::RowOutOfRange) {
        match &mut lay.explicit {
            Some((reqs, pos)) if !reqs.is_empty() => {
                let i = rng.below(reqs.len());
                pos[i] = lay.seq_lens[reqs[i]] + rng.below(3);
                expect_err = true;
            }
            Some(_) => {}
            None if !lay.seq_lens.is_empty() => {
                let b = rng.below(lay.seq_lens.len());
                lay.query_starts[b] = lay.seq_lens[b] + 1 + rng.below(3);
                expect_err = true;
            }
            None => {}
        }
    }
    let batch = match &lay.explicit {
        Some((reqs, pos)) => Batch::explicit(&lay.seq_lens, reqs, pos, lay.ratio),
        None => Batch::contiguous(&lay.seq_lens, &lay.query_starts, lay.ratio),
    };
    let batch = match batch {
        Ok(b) => {
            assert!(
                !expect_err,
                "defect {defect:?} accepted by the batch: {lay:?}"
            );
            b
        }
        Err(e) => {
            assert!(expect_err, "valid batch rejected: {e} ({lay:?})");
            STATS.note(format!("batch:{}", kind(&e)));
            return;
        }
    };
    check_layout(&batch);

    let (h, d) = (lay.heads, lay.dim);
    let mut params = spec.params();
    let mut tail = spec.tail();
    let mut budgets = spec.budgets();
    let mut src_q = spec.queries(&mut rng, batch.num_rows(), h, d);
    let mut keys = spec.keys(&mut rng, batch.num_keys(), d);
    let role_sel = spec.role % 3;
    match defect {
        Some(Defect::ZeroTopk) => params.topk = 0,
        Some(Defect::NarrowPage) => params.page_cols = Some(params.topk - 1),
        Some(Defect::ZeroBlock) => params.block_size = 0,
        Some(Defect::ZeroBlocks) => params.num_blocks = 0,
        Some(Defect::ZeroTail) if role_sel != 0 => tail = Some(0),
        Some(Defect::ZeroBudget) => budgets = [0, 0],
        _ => {}
    }
    // Defects the problem itself must reject.
    let mut bad_problem = matches!(
        defect,
        Some(Defect::ZeroTopk | Defect::NarrowPage | Defect::ZeroBlock | Defect::ZeroBlocks)
    ) || (defect == Some(Defect::ZeroTail) && role_sel != 0);

    if role_sel != 2 {
        if let Some(d) = defect {
            bad_problem |= corrupt_inputs(d, &mut rng, &mut src_q, &mut keys);
        }
        let role = if role_sel == 0 {
            Role::Plain
        } else {
            Role::Source { tail }
        };
        let p = match Problem::new(&batch, inputs(&src_q, &keys), params, role) {
            Ok(p) => {
                assert!(!bad_problem, "defect {defect:?} accepted: {spec:?}");
                p
            }
            Err(e) => {
                assert!(bad_problem, "valid problem rejected: {e} ({spec:?})");
                STATS.note(format!("problem:{}", kind(&e)));
                return;
            }
        };
        compare(&p, budgets, spec.threads, backend);
        STATS.reached();
        return;
    }

    // Consumer: the source runs on the same batch and keys, then the consumer runs on
    // the tail batch with its own queries and weights.
    let src = match Problem::new(&batch, inputs(&src_q, &keys), params, Role::Source { tail }) {
        Ok(p) => p,
        Err(e) => {
            assert!(bad_problem, "valid source rejected: {e} ({spec:?})");
            STATS.note(format!("source:{}", kind(&e)));
            return;
        }
    };
    let mut published = reference::run(&src).published.expect("a source publishes");
    let cbatch = match tail {
        Some(t) => batch.tail(t).expect("tail >= 1"),
        None => batch.clone(),
    };
    // SPEC 6: the consumer's rows are the source's rows at `p >= S_b - tail`, in order.
    let want_rows: Vec<(usize, usize)> = batch
        .rows()
        .iter()
        .filter(|r| tail.is_none_or(|t| r.position + t >= lay.seq_lens[r.request]))
        .map(|r| (r.request, r.position))
        .collect();
    let got_rows: Vec<(usize, usize)> = cbatch
        .rows()
        .iter()
        .map(|r| (r.request, r.position))
        .collect();
    assert_eq!(got_rows, want_rows, "tail batch rows");
    assert_eq!(published.rows, want_rows, "published rows");
    let mut cq = spec.queries(&mut rng, cbatch.num_rows(), h, d);
    if let Some(d) = defect {
        bad_problem |= corrupt_inputs(d, &mut rng, &mut cq, &mut keys);
    }
    let t = published.rows.len();
    match defect {
        Some(Defect::BadCandidate) if t > 0 => {
            let i = rng.below(t);
            let row = cbatch.rows()[i];
            let nb = row.n.div_ceil(params.block_size.max(1));
            let c = rng.below(params.num_blocks.max(1));
            published.blocks[[i, c]] = nb as i32 + rng.below(4) as i32;
            bad_problem = true;
        }
        Some(Defect::MissingCandidateRow) if t > 0 => {
            published.rows.pop();
            published.blocks = published.blocks.slice(ndarray::s![..t - 1, ..]).to_owned();
            bad_problem = true;
        }
        _ => {}
    }
    let p = match Problem::new(
        &cbatch,
        inputs(&cq, &keys),
        params,
        Role::Consumer(&published),
    ) {
        Ok(p) => {
            assert!(!bad_problem, "defect {defect:?} accepted: {spec:?}");
            p
        }
        Err(e) => {
            assert!(bad_problem, "valid consumer rejected: {e} ({spec:?})");
            STATS.note(format!("consumer:{}", kind(&e)));
            return;
        }
    };
    compare(&p, budgets, spec.threads, backend);
    // SPEC 6: when every row keeps all its visible blocks, the consumer selects what a
    // plain layer would.
    let all_kept = cbatch
        .rows()
        .iter()
        .all(|r| r.n.div_ceil(p.block_size) <= p.num_blocks);
    if all_kept {
        let plain = Problem::new(&cbatch, inputs(&cq, &keys), params, Role::Plain)
            .expect("the consumer's inputs are valid for a plain layer");
        assert_eq!(
            reference::run(&p).raw,
            reference::run(&plain).raw,
            "consumer keeping every block differs from a plain layer"
        );
    }
    STATS.reached();
}

/// SPEC 3 for a validated batch, computed independently.
pub fn check_layout(batch: &Batch) {
    let r = batch.ratio();
    let mut off = 0usize;
    for req in batch.requests() {
        assert_eq!(req.key_offset, off, "key offset");
        assert_eq!(req.keys, req.seq_len / r, "lc_b");
        off += req.keys;
    }
    assert_eq!(batch.num_keys(), off, "L");
    for row in batch.rows() {
        let req = batch.requests()[row.request];
        assert!(row.position < req.seq_len, "position < S_b");
        assert_eq!(row.n, (row.position + 1) / r, "n(p)");
        assert_eq!(row.ks, req.key_offset, "ks");
        assert!(
            row.ke() <= req.key_offset + req.keys,
            "ke within the request"
        );
    }
}

fn pools() -> &'static [rayon::ThreadPool] {
    static POOLS: std::sync::OnceLock<Vec<rayon::ThreadPool>> = std::sync::OnceLock::new();
    POOLS.get_or_init(|| {
        (1..=3)
            .map(|n| {
                rayon::ThreadPoolBuilder::new()
                    .num_threads(n)
                    .build()
                    .expect("a rayon pool")
            })
            .collect()
    })
}

/// Run `f` on a pool of `1 + threads % 3` rayon threads.
pub fn on_pool<R: Send>(threads: u8, f: impl FnOnce() -> R + Send) -> R {
    pools()[(threads % 3) as usize].install(f)
}

fn compare(p: &Problem, budgets: [usize; 2], threads: u8, backend: &mut dyn Subject) {
    let want = reference::run(p);
    check_output(p, &want);
    let want_logits = reference::logits(p);
    let bound = backend.bound(p);
    for budget in budgets {
        let got = backend.run(p, budget, threads);
        let logits = backend.logits(p, budget, threads);
        if budget == 0 {
            match got {
                Err(e) => STATS.note(format!("budget0:{}", kind(&e))),
                Ok(_) => panic!("budget 0 accepted"),
            }
            continue;
        }
        let mut own = None;
        for (name, l) in logits {
            let l = l.unwrap_or_else(|e| panic!("{name}: logits of a valid problem failed: {e}"));
            check_logits(p, &name, &l, &want_logits, bound);
            own.get_or_insert(l);
        }
        let (out, plan) = got.unwrap_or_else(|e| panic!("valid run failed: {e}"));
        check_plan(p, &plan, budget);
        // Bitwise logits: the reference's outputs. Within a bound: the reference's
        // selection from the backend's own logits (SPEC 5: same scores, same bits).
        let want = match (bound, own) {
            (Some(_), Some(l)) => select_from_scores(p, &l),
            _ => want.clone(),
        };
        assert_eq!(
            out.raw, want.raw,
            "raw differs from the reference (budget {budget})"
        );
        assert_eq!(
            out.page, want.page,
            "page differs from the reference (budget {budget})"
        );
        assert_eq!(
            out.published, want.published,
            "published candidates differ from the reference (budget {budget})"
        );
    }
}

/// The reference's epilogue (candidate blocks, top-k, index assembly) on given scores,
/// each row's `n` scores concatenated.
pub fn select_from_scores(p: &Problem, scores: &[f32]) -> Output {
    let mut out = Output::alloc(p);
    let mut s = reference::RowScratch::new(p);
    let (mut off, mut k) = (0usize, 0usize);
    for (i, row) in p.batch.rows().iter().enumerate() {
        let sc = &scores[off..off + row.n];
        off += row.n;
        let publishes = p.publishes(i);
        let mut keys = vec![
            0u32;
            if publishes {
                row.n.div_ceil(p.block_size)
            } else {
                0
            }
        ];
        let mut blocks = publishes.then(|| vec![-1i32; p.num_blocks]);
        let mut raw = vec![-1i32; p.topk];
        let mut page = vec![-1i32; p.page_cols];
        reference::finish_row(
            p,
            i,
            sc,
            &mut keys,
            blocks.as_deref_mut(),
            &mut raw,
            &mut page,
            &mut s,
        );
        out.raw.row_mut(i).assign(&ndarray::ArrayView1::from(&raw));
        out.page
            .row_mut(i)
            .assign(&ndarray::ArrayView1::from(&page));
        if let (Some(b), Some(pb)) = (blocks, out.published.as_mut()) {
            pb.blocks.row_mut(k).assign(&ndarray::ArrayView1::from(&b));
            k += 1;
        }
    }
    out
}

/// Logits bitwise (`bound = None`) or within `bound(p, i, j, M)` of the reference's.
pub fn check_logits(p: &Problem, name: &str, got: &[f32], want: &[f32], bound: Option<LogitBound>) {
    assert_eq!(got.len(), want.len(), "{name}: logits length");
    let mut off = 0usize;
    for (i, row) in p.batch.rows().iter().enumerate() {
        for j in 0..row.n {
            let (x, r) = (got[off + j], want[off + j]);
            let same = x.to_bits() == r.to_bits() || (x.is_nan() && r.is_nan());
            match bound {
                None => assert!(
                    same,
                    "{name}: logit [{i}, {j}] = {x:e} ({:#010x}), reference {r:e} ({:#010x})",
                    x.to_bits(),
                    r.to_bits()
                ),
                Some(bound) if !same => {
                    let b = bound(p, i, j, magnitude(p, i, j));
                    let ok = if x.is_finite() && r.is_finite() {
                        (x as f64 - r as f64).abs() <= b
                    } else {
                        // Overflow: allowed only where the bound reaches f32's range.
                        b >= f32::MAX as f64 * 2f64.powi(-24)
                    };
                    assert!(
                        ok,
                        "{name}: logit [{i}, {j}] = {x:e}, reference {r:e}, bound {b:e}"
                    );
                }
                Some(_) => {}
            }
        }
        off += row.n;
    }
}

/// SPEC 4's `M` for row `i`, visible key `j`:
/// `kscale_j * sum_h |w_h| * sum_g c_g * sum_{d in g} |q_d * k_d|`.
pub fn magnitude(p: &Problem, i: usize, j: usize) -> f64 {
    use dsa_indexer::formats::{e2m1, e4m3, ue8m0};
    let x = p.batch.rows()[i].ks + j;
    let (d, g) = (p.dim, p.dim / 32);
    let (kv, kc, ks): (Vec<f64>, Vec<f64>, f64) = match p.inputs.k {
        Keys::E4m3 { codes, scale } => (
            codes
                .row(x)
                .iter()
                .map(|&b| e4m3::decode(b) as f64)
                .collect(),
            vec![1.0; g],
            scale[x] as f64,
        ),
        Keys::E2m1 { packed, scale } => {
            let row = packed.row(x).to_vec();
            (
                (0..d)
                    .map(|e| e2m1::decode(e2m1::unpack(&row, e)) as f64)
                    .collect(),
                scale
                    .row(x)
                    .iter()
                    .map(|&e| ue8m0::decode(e) as f64)
                    .collect(),
                1.0,
            )
        }
    };
    let mut m = 0f64;
    for h in 0..p.heads {
        let (qv, qc): (Vec<f64>, Vec<f64>) = match p.inputs.q {
            Queries::E4m3(q) => (
                q.slice(ndarray::s![i, h, ..])
                    .iter()
                    .map(|&b| e4m3::decode(b) as f64)
                    .collect(),
                vec![1.0; g],
            ),
            Queries::E2m1 { packed, scale } => {
                let row = packed.slice(ndarray::s![i, h, ..]).to_vec();
                (
                    (0..d)
                        .map(|e| e2m1::decode(e2m1::unpack(&row, e)) as f64)
                        .collect(),
                    scale
                        .slice(ndarray::s![i, h, ..])
                        .iter()
                        .map(|&e| ue8m0::decode(e) as f64)
                        .collect(),
                )
            }
        };
        let mut sum = 0f64;
        for gg in 0..g {
            let dots: f64 = (gg * 32..gg * 32 + 32).map(|e| (qv[e] * kv[e]).abs()).sum();
            sum += qc[gg] * kc[gg] * dots;
        }
        m += (p.inputs.weights[[i, h]] as f64).abs() * sum;
    }
    ks * m
}

/// SPEC 5 and 6 shape rules of an output, independent of how it was computed.
pub fn check_output(p: &Problem, out: &Output) {
    let rows = p.batch.rows();
    assert_eq!(out.raw.dim(), (rows.len(), p.topk), "raw shape");
    assert_eq!(out.page.dim(), (rows.len(), p.page_cols), "page shape");
    for (i, row) in rows.iter().enumerate() {
        let raw = out.raw.row(i);
        let sel: Vec<i32> = raw.iter().copied().take_while(|&j| j >= 0).collect();
        assert!(raw.iter().skip(sel.len()).all(|&j| j == -1), "raw padding");
        assert!(sel.windows(2).all(|w| w[0] < w[1]), "raw ascending");
        assert!(sel.iter().all(|&j| (j as usize) < row.n), "raw visible");
        if !matches!(p.role, Role::Consumer(_)) {
            assert_eq!(sel.len(), row.n.min(p.topk), "raw count");
        }
        for (c, &g) in out.page.row(i).iter().enumerate() {
            let want = sel.get(c).map_or(-1, |&j| p.slot(row.ks + j as usize));
            assert_eq!(g, want, "page[{i}, {c}]");
        }
    }
    if let Some(pb) = &out.published {
        let mut k = 0;
        for (i, row) in rows.iter().enumerate() {
            // SPEC 6, independently of the crate: the rows at `p >= S_b - tail`.
            let s = p.batch.requests()[row.request].seq_len as u128;
            let publishes = match p.role {
                Role::Source { tail: Some(t) } => row.position as u128 + t as u128 >= s,
                _ => true,
            };
            assert_eq!(p.publishes(i), publishes, "row {i} publishes");
            if !publishes {
                continue;
            }
            assert_eq!(pb.rows[k], (row.request, row.position), "published row");
            let ids: Vec<i32> = pb
                .blocks
                .row(k)
                .iter()
                .copied()
                .take_while(|&c| c >= 0)
                .collect();
            let nb = row.n.div_ceil(p.block_size);
            assert_eq!(ids.len(), nb.min(p.num_blocks), "kept blocks count");
            assert!(ids.windows(2).all(|w| w[0] < w[1]), "kept ascending");
            if row.n > 0 {
                assert!(
                    ids.contains(&(((row.n - 1) / p.block_size) as i32)),
                    "pinned block kept"
                );
            }
            k += 1;
        }
        assert_eq!(k, pb.rows.len(), "published row count");
    }
}

/// SPEC 7: tiles cover the rows in order; each fits the budget or is one oversized row.
pub fn check_plan(p: &Problem, plan: &Plan, budget: usize) {
    let mut next = 0;
    let mut pubs = 0;
    for t in &plan.tiles {
        assert_eq!(t.rows.start, next, "tiles in order");
        assert!(!t.rows.is_empty(), "empty tile");
        next = t.rows.end;
        assert_eq!(t.published.start, pubs, "published ranges in order");
        pubs += t.rows.clone().filter(|&i| p.publishes(i)).count();
        assert_eq!(t.published.end, pubs, "published range");
        if t.logits_bytes > budget {
            assert!(t.oversized && t.rows.len() == 1, "tile over budget");
        }
        assert!(t.logits_bytes <= plan.peak.logits_tile, "peak covers tiles");
    }
    assert_eq!(next, p.batch.num_rows(), "tiles cover the rows");
}

/// Seeds: the property tests' boundary cases (SPEC 3 worked example, `n` around `K`
/// and `B * NB`, empty and one-row requests, explicit rows, every format pair, role and
/// ratio, ties, tiny budgets), as `(name, spec)`.
pub fn seeds() -> Vec<(String, Spec)> {
    let base = Spec {
        seed: 7,
        ..Spec::default()
    };
    let mut out = Vec::new();
    let mut push = |name: String, s: Spec| out.push((name, s));
    // SPEC 3's worked example: seq_lens [10, 4], query_starts [7, 2], ratios 1 and 2.
    for ratio in [0u8, 1] {
        push(
            format!("spec3_example_r{}", ratio + 1),
            Spec {
                ratio,
                n_requests: 0,
                requests: [(10, 3), (4, 2), (0, 0), (0, 0)],
                ..base.clone()
            },
        );
    }
    // Format pairs x roles x ratios, n around K = 8 and B * NB = 4 * 3 = 12, ties.
    for (f, (qf, kf)) in [(false, false), (false, true), (true, false), (true, true)]
        .into_iter()
        .enumerate()
    {
        for role in 0u8..3 {
            for (ri, ratio) in [0u8, 1, 3].into_iter().enumerate() {
                for narrow in [false, true] {
                    let pal = |v: [u8; 8]| if narrow { (3, v) } else { (0, v) };
                    push(
                        format!(
                            "fmt{f}_role{role}_r{ri}_{}",
                            if narrow { "ties" } else { "wide" }
                        ),
                        Spec {
                            ratio,
                            n_requests: 2,
                            requests: [(13, 13), (8, 8), (0, 0), (1, 1)],
                            q_fp4: qf,
                            k_fp4: kf,
                            q_palette: pal([0x38, 0x30, 0xB8, 0, 0, 0, 0, 0]),
                            k_palette: pal([0x38, 0x40, 0x22, 0, 0, 0, 0, 0]),
                            scale_palette: (1, [127, 0, 0, 0, 0, 0, 0, 0]),
                            topk: 7,
                            block_size: 3,
                            num_blocks: 2,
                            role,
                            tail: (role != 0).then_some(4),
                            budgets: [17, 64],
                            threads: role + ratio,
                            ..base.clone()
                        },
                    );
                }
            }
        }
    }
    // Explicit rows, duplicates, k_slots, page_cols > K, wide heads and dims.
    for (i, (heads, dim)) in [(7u8, 3u8), (6, 2), (4, 1), (0, 0)].into_iter().enumerate() {
        push(
            format!("explicit_h{heads}_d{dim}"),
            Spec {
                n_requests: 3,
                requests: [(17, 5), (40, 0), (3, 3), (0, 0)],
                explicit: 1,
                n_explicit: 12 + i as u8,
                heads,
                dim,
                slots: true,
                page_extra: Some(3),
                topk: 2,
                budgets: [4, 1],
                role: i as u8 % 3,
                tail: Some(1),
                ..base.clone()
            },
        );
    }
    // Overflow to infinity and NaN logits: huge weights and key scales, extreme UE8M0.
    push(
        "overflow_inf_nan".into(),
        Spec {
            n_requests: 1,
            requests: [(24, 24), (0, 0), (0, 0), (0, 0)],
            w_palette: (4, [3e38, -3e38, 0.0, -0.0]),
            kscale_palette: (2, [3e38, 1e-45, 0.0, 0.0]),
            scale_palette: (3, [254, 1, 0, 0, 0, 0, 0, 0]),
            topk: 5,
            block_size: 2,
            num_blocks: 3,
            role: 1,
            ..base.clone()
        },
    );
    // One defect of each kind.
    for d in 0..DEFECTS.len() as u8 {
        push(
            format!("defect_{d:02}"),
            Spec {
                corrupt: 48 + d,
                n_requests: 0,
                requests: [(12, 6), (9, 9), (0, 0), (0, 0)],
                role: [0, 1, 2, 2][d as usize % 4],
                tail: Some(3),
                explicit: (d == 13) as u8,
                n_explicit: 5,
                ..base.clone()
            },
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use arbitrary::{Arbitrary, Unstructured};

    #[test]
    fn seeds_round_trip_through_arbitrary() {
        for (name, s) in seeds() {
            let b = s.to_bytes();
            let back = Spec::arbitrary_take_rest(Unstructured::new(&b)).unwrap();
            assert_eq!(back.to_bytes(), b, "{name}");
            assert_eq!(format!("{back:?}"), format!("{s:?}"), "{name}");
        }
    }

    /// `FUZZ_SPEC=<artifact> cargo test --manifest-path fuzz/Cargo.toml --release print_spec
    /// -- --nocapture` prints a `chunked_vs_reference` / `cuda_vs_reference` input decoded.
    #[test]
    fn print_spec() {
        let Some(path) = std::env::var_os("FUZZ_SPEC") else {
            return;
        };
        let bytes = std::fs::read(path).unwrap();
        let s = Spec::arbitrary_take_rest(Unstructured::new(&bytes)).unwrap();
        println!(
            "{s:#?}\n{:#?}\nparams {:?} tail {:?} budgets {:?} defect {:?}",
            s.layout(),
            s.params(),
            s.tail(),
            s.budgets(),
            s.defect()
        );
    }

    /// fuzz/FINDINGS.md F3, without a GPU: the committed input
    /// `corpus/cuda_vs_reference/regress_subnormal_kscale_bound` through [`check`] with
    /// the H200's logits (the reference's, logit `[13, 0]` one subnormal ulp lower, as
    /// the run recorded) passes under `cuda::logit_bound`, and that difference exceeds
    /// the bound's relative part `2^TOLERANCE_LOG2 * M` alone.
    #[cfg(feature = "cuda")]
    #[test]
    fn f3_subnormal_logit_is_within_the_cuda_bound() {
        use dsa_indexer::cuda;

        /// The reference's logits with the H200's logit `[13, 0]`; records
        /// `(device, reference, M, stated bound)` of that logit.
        struct H200F3(Vec<(f32, f32, f64, f64)>);
        impl H200F3 {
            fn logits_of(&mut self, p: &Problem) -> Vec<f32> {
                let mut l = reference::logits(p);
                let (i, j) = (13, 0);
                let x: usize = p.batch.rows()[..i].iter().map(|r| r.n).sum::<usize>() + j;
                let r = l[x];
                l[x] = f32::from_bits(r.to_bits() - 1);
                let m = magnitude(p, i, j);
                self.0.push((l[x], r, m, cuda::logit_bound(p, i, j, m)));
                l
            }
        }
        impl Subject for H200F3 {
            fn run(&mut self, p: &Problem, budget: usize, _threads: u8) -> BackendRun {
                let (_, plan) = dsa_indexer::indexer::run_cpu(p, budget)?;
                Ok((select_from_scores(p, &self.logits_of(p)), plan))
            }
            fn logits(
                &mut self,
                p: &Problem,
                _budget: usize,
                _threads: u8,
            ) -> Vec<(String, Result<Vec<f32>>)> {
                vec![("h200".into(), Ok(self.logits_of(p)))]
            }
            fn bound(&self, p: &Problem) -> Option<LogitBound> {
                (!cuda::is_bitwise(p)).then_some(cuda::logit_bound as LogitBound)
            }
        }

        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("corpus/cuda_vs_reference/regress_subnormal_kscale_bound");
        let bytes = std::fs::read(path).unwrap();
        let spec = Spec::arbitrary_take_rest(Unstructured::new(&bytes)).unwrap();
        let mut dev = H200F3(Vec::new());
        check(&spec, &mut dev);
        assert!(!dev.0.is_empty(), "the case reached the comparison");
        for &(x, r, m, b) in &dev.0 {
            // FINDINGS.md: device 5.769e-42, reference 5.770e-42 (4117 and 4118 * 2^-149).
            assert_eq!((x.to_bits(), r.to_bits()), (0x1015, 0x1016));
            // The figures tests/cuda.rs checks without this file.
            assert_eq!(m, 2.5587764977137906e-41);
            let diff = r as f64 - x as f64;
            assert_eq!(diff, 2f64.powi(-149));
            assert!(
                2f64.powi(cuda::TOLERANCE_LOG2) * m < diff,
                "outside the old bound"
            );
            assert!(diff <= b, "inside the stated bound {b:e}");
        }
    }

    #[test]
    fn short_inputs_decode_as_zero_padded() {
        let s = Spec::arbitrary_take_rest(Unstructured::new(&[])).unwrap();
        assert_eq!(s, Spec::default());
        let s = Spec::arbitrary_take_rest(Unstructured::new(&[49, 3])).unwrap();
        assert_eq!((s.corrupt, s.ratio, s.n_requests), (49, 3, 0));
    }

    fn topk_seeds() -> Vec<(String, Vec<u8>)> {
        let mut out = Vec::new();
        // n around K and around B * NB = 3 * 4, every score mode, all-ties rows.
        for n in [0usize, 1, 2, 11, 12, 13, 40] {
            for (kname, k) in [
                ("km1", n.saturating_sub(2)),
                ("k", n.saturating_sub(1)),
                ("kp1", n),
            ] {
                for mode in 0u8..4 {
                    let mut b = vec![k as u8, 2, 3, mode, 0b1011_0101, 0, 0, 0x80];
                    for j in 0..n as u32 {
                        let w = match mode {
                            0 => (j.wrapping_mul(0x9E37_79B9) >> 7) | 0x3F00_0000,
                            _ => j.wrapping_mul(7) % 32,
                        };
                        b.extend(w.to_le_bytes());
                    }
                    out.push((format!("n{n}_{kname}_mode{mode}"), b));
                }
            }
        }
        // Every special value, in order, then reversed.
        let mut b = vec![5, 0, 7, 1, 0xFF, 0xFF, 0xFF, 0xFF];
        (0u32..16)
            .chain((0..16).rev())
            .for_each(|w| b.extend(w.to_le_bytes()));
        out.push(("specials".into(), b));
        out
    }

    fn codecs_seeds() -> Vec<(String, Vec<u8>)> {
        let mut out = Vec::new();
        let specials: [f32; 18] = [
            448.0,
            464.0,
            480.0,
            -464.0,
            -0.0,
            2f32.powi(-10),
            -2f32.powi(-10),
            2.5,
            5.0,
            0.25,
            0.75,
            -0.25,
            6.0,
            7.0,
            f32::NAN,
            f32::INFINITY,
            f32::from_bits(0x0040_0000),
            f32::from_bits(1),
        ];
        for (i, &x) in specials.iter().enumerate() {
            let mut b = vec![i as u8 * 15, i as u8, i as u8 * 14, i as u8 % 4];
            b.extend(x.to_le_bytes());
            out.push((format!("scalar_{i:02}"), b));
        }
        // The golden quantizer rows (tests/golden/quantizers.safetensors, x F32 [rows, 128]).
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/golden/quantizers.safetensors");
        let buf = std::fs::read(&path).expect("golden quantizers");
        let st = safetensors::SafeTensors::deserialize(&buf).unwrap();
        let x = st.tensor("x").unwrap();
        for (r, row) in x.data().chunks(128 * 4).enumerate() {
            let mut b = vec![0x7E, 0x8, 0, r as u8 % 4];
            b.extend(1e-4f32.to_le_bytes());
            b.extend(row);
            out.push((format!("golden_quantizers_row{r:02}"), b));
        }
        out
    }

    fn batch_seeds() -> Vec<(String, Vec<u8>)> {
        let rec = |s: u64, second: u64| [s.to_le_bytes(), second.to_le_bytes()].concat();
        let small = |v: u64| v; // top bits 00: v % 64
        let huge = |v: u64| (1u64 << 62) | v; // usize::MAX - v % 64
        let mut out = Vec::new();
        // SPEC 3's worked example, ratios 1 and 2, contiguous and explicit.
        for (name, class, r) in [("r1", 1u8, 0u64), ("r2", 8, 1)] {
            let mut b = vec![0u8, class];
            b.extend(r.to_le_bytes());
            b.extend(rec(small(10), 7));
            b.extend(rec(small(4), 2));
            out.push((format!("spec3_{name}"), b.clone()));
            b[0] = 1;
            out.push((format!("spec3_explicit_{name}"), b));
        }
        // L overflows usize; T overflows usize; one request of usize::MAX tokens, no rows.
        for (name, recs) in [
            (
                "keys_overflow",
                vec![rec(huge(0), huge(0)), rec(huge(0), huge(0))],
            ),
            ("rows_overflow", vec![rec(huge(0), 0), rec(huge(1), 0)]),
            (
                "max_no_rows",
                vec![rec(huge(0), 2 << 10), rec(small(3), 1 << 10)],
            ),
        ] {
            let mut b = vec![0u8, 1, 0, 0, 0, 0, 0, 0, 0, 0];
            recs.iter().for_each(|r| b.extend(r));
            out.push((name.into(), b));
        }
        out
    }

    /// `WRITE_SEEDS=1 cargo test --manifest-path fuzz/Cargo.toml` rewrites the committed
    /// seeds (`corpus/<target>/seed_*`) of every target but `dump_parse`, whose seeds
    /// are the golden files.
    #[test]
    fn write_seeds() {
        if std::env::var_os("WRITE_SEEDS").is_none() {
            return;
        }
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
        let spec: Vec<(String, Vec<u8>)> = seeds()
            .into_iter()
            .map(|(n, s)| (n, s.to_bytes()))
            .collect();
        for (target, files) in [
            ("chunked_vs_reference", spec.clone()),
            ("cuda_vs_reference", spec),
            ("topk", topk_seeds()),
            ("codecs", codecs_seeds()),
            ("batch_layout", batch_seeds()),
        ] {
            let dir = root.join(target);
            std::fs::create_dir_all(&dir).unwrap();
            for (name, bytes) in files {
                std::fs::write(dir.join(format!("seed_{name}")), bytes).unwrap();
            }
        }
    }
}
