//! The fast CPU logits engine: the same arithmetic as the reference (bitwise), laid out
//! for speed. Nothing is allocated per row: every buffer lives in the per-worker
//! [`Engine`], whose size [`Engine::bytes`] the planner accounts for.
//!
//! **Exact class (fp4 x fp4).** Rows are scored in groups of [`ROW_GROUP`] against
//! blocks of [`LANES`] keys. A key block is transposed once into `[D/4, LANES]` quad
//! words, each four doubled E2M1 values plus 12 as unsigned bytes (`0..=24`); a query
//! row's quad words hold its doubled values as signed bytes. One `vpdpbusd` lane (or
//! `vpmaddubsw` + `vpmaddwd`, or the portable loop) accumulates `(2k + 12) * 2q` over a
//! group's 32 dimensions; subtracting the query's `12 * sum 2q` leaves `4 * s_g`
//! exactly (an integer, `|4 s_g| <= 4608`). The epilogue then runs lane-wise in SPEC
//! 4's f32 order: `t_g = (f32(4 s_g) * 0.25 * qs_g) * ks_g` (the `* 0.25` is exact),
//! the pairwise sum over groups, `relu`, `* w_h`, the pairwise sum over heads, four
//! heads per key load. Every step is one IEEE f32 operation per lane (no FMA: Rust
//! never contracts), so each lane is bitwise the reference's scalar result. The dot
//! products pick the widest of AVX-512 VNNI, AVX2 and a portable loop at run time
//! ([`Isa::detect`]).
//!
//! **Tolerance class (any E4M3 side).** Exact f64 group sums (every partial sum of
//! products of E4M3/E2M1 values is exact in f64, so any order gives `s_g`), then the
//! f64 pairwise sum over groups, rounded once to f32, as the reference does. Since the
//! order is free, the sums run as independent vector chains over the key block (four a
//! vector, a group's dims split between them where `G < 4`): fused multiply-adds on
//! AVX-512 (neither form rounds anything here), multiplies and adds on AVX2.

use crate::batch::Row;
use crate::formats::{e2m1, e4m3, ue8m0};
use crate::problem::{Class, Format, KeyRef, Problem, Queries};

/// Rows scored together against each decoded key block.
pub const ROW_GROUP: usize = 8;

/// Keys per block in the exact class (one 512-bit vector of i32 lanes).
pub const LANES: usize = 16;

/// Instruction set used for the exact class's integer dot products.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// Plain Rust loops (any target).
    Portable,
    /// x86-64 AVX2 (`vpmaddwd`).
    Avx2,
    /// x86-64 AVX-512 F/BW with VNNI (`vpdpwssd`).
    Avx512Vnni,
}

impl Isa {
    /// The widest instruction set this CPU supports (`DSA_INDEXER_ISA=portable|avx2`
    /// caps it, for testing and comparison).
    pub fn detect() -> Isa {
        let best = Self::best();
        match std::env::var("DSA_INDEXER_ISA").ok().as_deref() {
            Some("portable") => Isa::Portable,
            Some("avx2") => best.min(Isa::Avx2),
            _ => best,
        }
    }

    fn best() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512vnni")
            {
                return Isa::Avx512Vnni;
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                return Isa::Avx2;
            }
        }
        Isa::Portable
    }

    /// Every instruction set this CPU can run, narrowest first.
    pub fn available() -> Vec<Isa> {
        let best = Self::best();
        [Isa::Portable, Isa::Avx2, Isa::Avx512Vnni]
            .into_iter()
            .filter(|&i| i <= best)
            .collect()
    }

    /// Short name.
    pub fn name(&self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512Vnni => "avx512-vnni",
        }
    }
}

/// Each packed E2M1 byte as two signed bytes of doubled values (the query side):
/// element `2e` (low nibble) first.
static Q_BYTES: [u16; 256] = {
    let mut t = [0u16; 256];
    let mut b = 0;
    while b < 256 {
        let lo = e2m1::DOUBLED[b & 0xF] as u8 as u16;
        let hi = e2m1::DOUBLED[b >> 4] as u8 as u16;
        t[b] = lo | (hi << 8);
        b += 1;
    }
    t
};

/// Each packed E2M1 byte as two unsigned bytes of doubled values plus [`K_BIAS`] (the
/// key side, in `0..=24`), element `2e` first.
static K_BYTES: [u16; 256] = {
    let mut t = [0u16; 256];
    let mut b = 0;
    while b < 256 {
        let lo = (e2m1::DOUBLED[b & 0xF] + K_BIAS as i8) as u8 as u16;
        let hi = (e2m1::DOUBLED[b >> 4] + K_BIAS as i8) as u8 as u16;
        t[b] = lo | (hi << 8);
        b += 1;
    }
    t
};

/// Bias that makes a doubled key value unsigned: `2k + 12` is in `0..=24`.
const K_BIAS: i32 = 12;

/// The quad word of dims `4w .. 4w + 3` from packed bytes `2w`, `2w + 1` (byte `t` of
/// the little-endian word is dim `4w + t`).
#[inline]
fn quad(lut: &[u16; 256], b0: u8, b1: u8) -> i32 {
    (lut[b0 as usize] as u32 | (lut[b1 as usize] as u32) << 16) as i32
}

/// Per-worker operand buffers.
#[derive(Debug)]
pub struct Engine {
    heads: usize,
    dim: usize,
    class: Class,
    isa: Isa,
    /// Exact class: quad words of the group's doubled query values (4 x i8)
    /// `[R, H, D/4]`.
    q_quads: Vec<i32>,
    /// Exact class: `K_BIAS * sum_{d in g} 2 q_d` per `[R, H, G]`, the bias's share of
    /// each biased group dot.
    q_corr: Vec<i32>,
    /// Tolerance class: query values `[R, H, D]`.
    q_f64: Vec<f64>,
    /// Query group scales `[R, H, G]` (fp4 queries).
    q_scale: Vec<f32>,
    /// Weights `[R, H]`.
    w: Vec<f32>,
    /// Exact class: the key block's biased quad words (4 x u8), transposed `[D/4, LANES]`.
    k_quads: Vec<i32>,
    /// fp4 keys: the key block's group scales `[G, LANES]`.
    k_block_scale: Vec<f32>,
    /// Tolerance class: the key block's values, transposed `[D, LANES]`.
    k_block_f64: Vec<f64>,
    /// Tolerance class, E4M3 keys: the key block's per-key scales `[LANES]`.
    k_block_kscale: Vec<f32>,
}

impl Engine {
    /// Buffers for problem `p`, dot products on [`Isa::detect`].
    pub fn new(p: &Problem) -> Self {
        Self::with_isa(p, Isa::detect())
    }

    /// Buffers for problem `p`, dot products on `isa` (capped at what the CPU supports).
    pub fn with_isa(p: &Problem, isa: Isa) -> Self {
        let (h, d, g) = (p.heads, p.dim, p.dim / 32);
        let class = p.class();
        let exact = class == Class::Exact;
        Engine {
            heads: h,
            dim: d,
            class,
            isa: isa.min(Isa::best()),
            q_quads: vec![0; if exact { ROW_GROUP * h * d / 4 } else { 0 }],
            q_corr: vec![0; if exact { ROW_GROUP * h * g } else { 0 }],
            q_f64: vec![0.0; if exact { 0 } else { ROW_GROUP * h * d }],
            q_scale: vec![0.0; ROW_GROUP * h * g],
            w: vec![0.0; ROW_GROUP * h],
            k_quads: vec![0; if exact { d / 4 * LANES } else { 0 }],
            k_block_scale: vec![0.0; g * LANES],
            k_block_f64: vec![0.0; if exact { 0 } else { d * LANES }],
            k_block_kscale: vec![0.0; if exact { 0 } else { LANES }],
        }
    }

    /// The instruction set the exact class runs on.
    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// Heap bytes one engine holds for a problem of this shape.
    pub fn bytes(heads: usize, dim: usize, class: Class) -> usize {
        let (rh, g) = (ROW_GROUP * heads, dim / 32);
        let operands = match class {
            Class::Exact => rh * dim + rh * g * 4 + dim * LANES,
            Class::Tolerance => rh * dim * 8 + dim * LANES * 8 + LANES * 4,
        };
        operands + g * LANES * 4 + rh * g * 4 + rh * 4
    }

    fn load_rows(&mut self, p: &Problem, rows: &[usize]) {
        let (h, d, g) = (self.heads, self.dim, self.dim / 32);
        for (r, &i) in rows.iter().enumerate() {
            for hh in 0..h {
                self.w[r * h + hh] = p.inputs.weights[[i, hh]];
                match p.inputs.q {
                    Queries::E4m3(q) => {
                        let base = (r * h + hh) * d;
                        for e in 0..d {
                            self.q_f64[base + e] = e4m3::decode(q[[i, hh, e]]) as f64;
                        }
                    }
                    Queries::E2m1 { packed, scale } => {
                        if self.class == Class::Exact {
                            let base = (r * h + hh) * d / 4;
                            for w in 0..d / 4 {
                                let (b0, b1) = (packed[[i, hh, 2 * w]], packed[[i, hh, 2 * w + 1]]);
                                self.q_quads[base + w] = quad(&Q_BYTES, b0, b1);
                            }
                            for gg in 0..g {
                                let sum: i32 = (gg * 16..gg * 16 + 16)
                                    .map(|e| {
                                        let b = packed[[i, hh, e]];
                                        e2m1::DOUBLED[(b & 0xF) as usize] as i32
                                            + e2m1::DOUBLED[(b >> 4) as usize] as i32
                                    })
                                    .sum();
                                self.q_corr[(r * h + hh) * g + gg] = K_BIAS * sum;
                            }
                        } else {
                            let base = (r * h + hh) * d;
                            for e in 0..d {
                                let b = packed[[i, hh, e / 2]];
                                let c = if e % 2 == 0 { b & 0xF } else { b >> 4 };
                                self.q_f64[base + e] = e2m1::decode(c) as f64;
                            }
                        }
                        for gg in 0..g {
                            self.q_scale[(r * h + hh) * g + gg] = ue8m0::decode(scale[[i, hh, gg]]);
                        }
                    }
                }
            }
        }
    }

    /// Transpose keys `j0 .. j0 + count` of `row`'s request (`count <= LANES`; flat or
    /// paged, read in place) into the block buffers; lanes past `count` hold zero keys
    /// with unit scales.
    fn load_key_block(&mut self, p: &Problem, row: &Row, j0: usize, count: usize) {
        if self.class == Class::Exact {
            self.load_key_block_exact(p, row, j0, count);
            return;
        }
        let (d, g) = (self.dim, self.dim / 32);
        for lane in 0..LANES {
            if lane >= count {
                for e in 0..d {
                    self.k_block_f64[e * LANES + lane] = 0.0;
                }
                self.k_block_kscale[lane] = 1.0;
                for gg in 0..g {
                    self.k_block_scale[gg * LANES + lane] = 1.0;
                }
                continue;
            }
            match p.key(row, j0 + lane) {
                KeyRef::E4m3 { codes, scale } => {
                    for (e, &c) in codes.iter().enumerate() {
                        self.k_block_f64[e * LANES + lane] = e4m3::decode(c) as f64;
                    }
                    self.k_block_kscale[lane] = scale;
                }
                KeyRef::E2m1 { packed, scale } => {
                    for e in 0..d {
                        let b = packed[e / 2];
                        self.k_block_f64[e * LANES + lane] =
                            e2m1::decode(if e % 2 == 0 { b & 0xF } else { b >> 4 }) as f64;
                    }
                    for gg in 0..g {
                        self.k_block_scale[gg * LANES + lane] = ue8m0::decode(scale[gg]);
                    }
                }
            }
        }
    }

    /// Exact class: the quad words and group scales of a key block.
    fn load_key_block_exact(&mut self, p: &Problem, row: &Row, j0: usize, count: usize) {
        let (d4, g) = (self.dim / 4, self.dim / 32);
        for lane in 0..LANES {
            if lane < count {
                if let KeyRef::E2m1 { packed, scale } = p.key(row, j0 + lane) {
                    for w in 0..d4 {
                        self.k_quads[w * LANES + lane] =
                            quad(&K_BYTES, packed[2 * w], packed[2 * w + 1]);
                    }
                    for gg in 0..g {
                        self.k_block_scale[gg * LANES + lane] = ue8m0::decode(scale[gg]);
                    }
                }
            } else {
                for w in 0..d4 {
                    self.k_quads[w * LANES + lane] = 0;
                }
                for gg in 0..g {
                    self.k_block_scale[gg * LANES + lane] = 1.0;
                }
            }
        }
    }

    /// Exact class: logits of loaded row `r` against the loaded key block, per lane.
    fn exact_block(&self, r: usize, out: &mut [f32; LANES]) {
        match self.isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `isa` is capped by `Isa::best()`, which detected these features.
            Isa::Avx512Vnni => unsafe {
                match self.dim {
                    32 => x86::block_avx512::<1>(self, r, out),
                    64 => x86::block_avx512::<2>(self, r, out),
                    _ => x86::block_avx512::<4>(self, r, out),
                }
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above, AVX2 was detected.
            Isa::Avx2 => unsafe {
                match self.dim {
                    32 => x86::block_avx2::<1>(self, r, out),
                    64 => x86::block_avx2::<2>(self, r, out),
                    _ => x86::block_avx2::<4>(self, r, out),
                }
            },
            _ => match self.dim {
                32 => block_portable::<1>(self, r, out),
                64 => block_portable::<2>(self, r, out),
                _ => block_portable::<4>(self, r, out),
            },
        }
    }

    /// Tolerance class: logits of loaded row `r` against the loaded key block, per lane.
    fn tolerance_block(&self, r: usize, q_fp4: bool, k_fp4: bool, out: &mut [f32; LANES]) {
        match (self.isa, self.dim) {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `isa` is capped by `Isa::best()`, which detected these features.
            (Isa::Avx512Vnni, 32) => unsafe { x86::tol_avx512::<1>(self, r, q_fp4, k_fp4, out) },
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx512Vnni, 64) => unsafe { x86::tol_avx512::<2>(self, r, q_fp4, k_fp4, out) },
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx512Vnni, _) => unsafe { x86::tol_avx512::<4>(self, r, q_fp4, k_fp4, out) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above, AVX2 was detected.
            (Isa::Avx2, 32) => unsafe { x86::tol_avx2::<1>(self, r, q_fp4, k_fp4, out) },
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx2, 64) => unsafe { x86::tol_avx2::<2>(self, r, q_fp4, k_fp4, out) },
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx2, _) => unsafe { x86::tol_avx2::<4>(self, r, q_fp4, k_fp4, out) },
            (_, 32) => {
                tolerance_block_with::<1>(self, r, q_fp4, k_fp4, out, group_sums_portable::<1>)
            }
            (_, 64) => {
                tolerance_block_with::<2>(self, r, q_fp4, k_fp4, out, group_sums_portable::<2>)
            }
            _ => tolerance_block_with::<4>(self, r, q_fp4, k_fp4, out, group_sums_portable::<4>),
        }
    }

    /// Logits of up to [`ROW_GROUP`] rows: `out[r]` receives row `rows[r]`'s `n` scores.
    pub fn rows(&mut self, p: &Problem, rows: &[usize], out: &mut [&mut [f32]]) {
        debug_assert!(rows.len() <= ROW_GROUP && rows.len() == out.len());
        self.load_rows(p, rows);
        let q_fp4 = matches!(p.inputs.q, Queries::E2m1 { .. });
        let ns: [usize; ROW_GROUP] =
            std::array::from_fn(|r| rows.get(r).map_or(0, |&i| p.batch.rows()[i].n));
        let req: [usize; ROW_GROUP] =
            std::array::from_fn(|r| rows.get(r).map_or(0, |&i| p.batch.rows()[i].request));
        // Rows of one group may belong to different requests: walk each request's keys.
        let mut done = [false; ROW_GROUP];
        for r0 in 0..rows.len() {
            if done[r0] {
                continue;
            }
            let same: [bool; ROW_GROUP] =
                std::array::from_fn(|r| r < rows.len() && !done[r] && req[r] == req[r0]);
            let nmax = (0..ROW_GROUP)
                .filter(|&r| same[r])
                .map(|r| ns[r])
                .max()
                .unwrap_or(0);
            let k_fp4 = p.k_format() == Format::E2m1;
            let mut lanes = [0f32; LANES];
            let mut j0 = 0;
            while j0 < nmax {
                let count = (nmax - j0).min(LANES);
                self.load_key_block(p, &p.batch.rows()[rows[r0]], j0, count);
                for r in 0..rows.len() {
                    if same[r] && j0 < ns[r] {
                        if self.class == Class::Exact {
                            self.exact_block(r, &mut lanes);
                        } else {
                            self.tolerance_block(r, q_fp4, k_fp4, &mut lanes);
                        }
                        let m = (ns[r] - j0).min(LANES);
                        out[r][j0..j0 + m].copy_from_slice(&lanes[..m]);
                    }
                }
                j0 += LANES;
            }
            for r in 0..ROW_GROUP {
                done[r] |= same[r];
            }
        }
    }
}

/// SPEC 4 step 2 (exact class) and step 3 for one head, lane-wise: `acc[g]` holds
/// `4 * s_g` per key. Returns `w_h * relu(a_h)` per lane.
#[inline(always)]
fn head_term<const G: usize>(
    acc: &[[i32; LANES]; 4],
    q_scale: &[f32],
    k_scale: &[f32],
    w: f32,
    term: &mut [f32; LANES],
) {
    let mut t = [[0f32; LANES]; 4];
    for g in 0..G {
        let qs = q_scale[g];
        let ks = &k_scale[g * LANES..g * LANES + LANES];
        for l in 0..LANES {
            // 4 s_g is an integer below 2^13: exact in f32, and so is the * 0.25.
            let s = acc[g][l] as f32 * 0.25;
            t[g][l] = (s * qs) * ks[l];
        }
    }
    for l in 0..LANES {
        let a = match G {
            1 => t[0][l],
            2 => t[0][l] + t[1][l],
            _ => (t[0][l] + t[1][l]) + (t[2][l] + t[3][l]),
        };
        term[l] = w * if a > 0.0 { a } else { 0.0 };
    }
}

/// SPEC 4 step 4, lane-wise: the pairwise sum over `n` (a power of two) head terms,
/// adjacent pairs level by level (the same tree as halves of halves).
#[inline(always)]
fn heads_pairwise(terms: &mut [[f32; LANES]; 64], n: usize, out: &mut [f32; LANES]) {
    let mut n = n;
    while n > 1 {
        for i in 0..n / 2 {
            let (a, b) = (terms[2 * i], terms[2 * i + 1]);
            for (t, (x, y)) in terms[i].iter_mut().zip(a.iter().zip(&b)) {
                *t = x + y;
            }
        }
        n /= 2;
    }
    *out = terms[0];
}

/// Tolerance class, lane-wise (SPEC 4): `s_g` exact in f64 (every product of two
/// decoded E4M3/E2M1 values and every partial sum of 32 of them is exact in f64, so the
/// order is free), `t_g = s_g * c_g` with the fp4 side's group scale, the f64 pairwise
/// sum over groups rounded once to f32, `w * relu(a)`, the f32 pairwise sum over heads,
/// then `* kscale` for E4M3 keys.
///
/// `sums(q, kb, s)` fills `s[g]` with the `G` group sums of one head's query values `q`
/// (`[D]`) against the key block's values `kb` (`[D]` of `LANES` keys).
#[inline(always)]
fn tolerance_block_with<const G: usize>(
    e: &Engine,
    r: usize,
    q_fp4: bool,
    k_fp4: bool,
    out: &mut [f32; LANES],
    mut sums: impl FnMut(&[f64], &[[f64; LANES]], &mut [[f64; LANES]; 4]),
) {
    let (h, d) = (e.heads, e.dim);
    let (kb, _) = e.k_block_f64.as_chunks::<LANES>();
    let kb = &kb[..d];
    let mut terms = [[0f32; LANES]; 64];
    for (hh, term) in terms.iter_mut().enumerate().take(h) {
        let base = (r * h + hh) * d;
        let mut s = [[0f64; LANES]; 4];
        sums(&e.q_f64[base..base + d], kb, &mut s);
        let mut t = [[0f64; LANES]; 4];
        for g in 0..G {
            for l in 0..LANES {
                let c = if q_fp4 {
                    e.q_scale[(r * h + hh) * G + g] as f64
                } else if k_fp4 {
                    e.k_block_scale[g * LANES + l] as f64
                } else {
                    1.0
                };
                t[g][l] = s[g][l] * c;
            }
        }
        let w = e.w[r * h + hh];
        for l in 0..LANES {
            let a = match G {
                1 => t[0][l],
                2 => t[0][l] + t[1][l],
                _ => (t[0][l] + t[1][l]) + (t[2][l] + t[3][l]),
            } as f32;
            term[l] = w * if a > 0.0 { a } else { 0.0 };
        }
    }
    heads_pairwise(&mut terms, h, out);
    if !k_fp4 {
        for (o, s) in out.iter_mut().zip(&e.k_block_kscale) {
            *o *= s;
        }
    }
}

/// Portable group sums for [`tolerance_block_with`]: one group after another.
fn group_sums_portable<const G: usize>(q: &[f64], kb: &[[f64; LANES]], s: &mut [[f64; LANES]; 4]) {
    for (g, sg) in s.iter_mut().enumerate().take(G) {
        for dd in 0..32 {
            let (qd, kd) = (q[g * 32 + dd], &kb[g * 32 + dd]);
            for l in 0..LANES {
                sg[l] += qd * kd[l];
            }
        }
    }
}

/// Heads whose dot products are computed together (independent accumulator chains).
const HEAD_BLOCK: usize = 4;

/// Accumulators of [`HEAD_BLOCK`] heads: `acc[head][g][lane] = 4 * s_g`.
type Acc = [[[i32; LANES]; 4]; HEAD_BLOCK];

/// The epilogue of one row against the loaded block, given a dot-product routine that
/// fills `acc` with `4 * s_g` for the [`HEAD_BLOCK`] heads whose quad words `q`
/// (`[HEAD_BLOCK, D/4]`) and bias corrections `corr` (`[HEAD_BLOCK, G]`) it is given.
#[inline(always)]
fn block_with<const G: usize>(
    e: &Engine,
    r: usize,
    out: &mut [f32; LANES],
    mut dots: impl FnMut(&[i32], &[i32], &mut Acc),
) {
    let (h, d4) = (e.heads, e.dim / 4);
    let mut terms = [[0f32; LANES]; 64];
    let mut acc: Acc = [[[0; LANES]; 4]; HEAD_BLOCK];
    // H is a power of two >= 8, so head blocks tile it.
    for hb in (0..h).step_by(HEAD_BLOCK) {
        let base = r * h + hb;
        dots(
            &e.q_quads[base * d4..(base + HEAD_BLOCK) * d4],
            &e.q_corr[base * G..(base + HEAD_BLOCK) * G],
            &mut acc,
        );
        for (k, a) in acc.iter().enumerate() {
            head_term::<G>(
                a,
                &e.q_scale[(base + k) * G..(base + k + 1) * G],
                &e.k_block_scale,
                e.w[base + k],
                &mut terms[hb + k],
            );
        }
    }
    heads_pairwise(&mut terms, h, out);
}

/// Portable dot products on byte views of the quad words: per lane,
/// `sum_d (2k_d + 12) * 2q_d - corr = 4 s_g`.
fn block_portable<const G: usize>(e: &Engine, r: usize, out: &mut [f32; LANES]) {
    let d4 = e.dim / 4;
    // SAFETY: u8 has alignment 1 and every i32 is four bytes; q and k are viewed the
    // same way, so byte t of a key word meets byte t of the query word.
    let kb: &[u8] =
        unsafe { std::slice::from_raw_parts(e.k_quads.as_ptr() as *const u8, e.k_quads.len() * 4) };
    block_with::<G>(e, r, out, |q, corr, acc| {
        // SAFETY: as above.
        let qb: &[i8] = unsafe { std::slice::from_raw_parts(q.as_ptr() as *const i8, q.len() * 4) };
        for (hk, ah) in acc.iter_mut().enumerate() {
            for (gg, a) in ah.iter_mut().enumerate().take(G) {
                let mut s = [0i32; LANES];
                let qg = &qb[(hk * d4 + gg * 8) * 4..(hk * d4 + gg * 8 + 8) * 4];
                let kg = &kb[gg * 8 * LANES * 4..(gg + 1) * 8 * LANES * 4];
                for (qw, kw) in qg.chunks_exact(4).zip(kg.chunks_exact(4 * LANES)) {
                    let qv = [qw[0] as i32, qw[1] as i32, qw[2] as i32, qw[3] as i32];
                    for (sl, k) in s.iter_mut().zip(kw.chunks_exact(4)) {
                        *sl += k[0] as i32 * qv[0]
                            + k[1] as i32 * qv[1]
                            + k[2] as i32 * qv[2]
                            + k[3] as i32 * qv[3];
                    }
                }
                let c = corr[hk * G + gg];
                for (al, sl) in a.iter_mut().zip(s) {
                    *al = sl - c;
                }
            }
        }
    });
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{block_with, Engine, HEAD_BLOCK, LANES};
    use std::arch::x86_64::*;

    /// Tolerance class on AVX-512: the group sums as `vfmadd231pd` chains over the block's
    /// two vectors of 8 keys. A group's dims are split over `4 / G` chains (dims `c`,
    /// `c + 4 / G`, ...), so that every `G` runs four chains a vector. A fused
    /// multiply-add rounds once where a multiply and an add round twice; here neither
    /// rounds (every product and partial sum is exact, [`super::tolerance_block_with`]),
    /// so the sums are the same bits.
    #[target_feature(enable = "avx512f,avx2")]
    pub(super) unsafe fn tol_avx512<const G: usize>(
        e: &Engine,
        r: usize,
        q_fp4: bool,
        k_fp4: bool,
        out: &mut [f32; LANES],
    ) {
        super::tolerance_block_with::<G>(e, r, q_fp4, k_fp4, out, |q, kb, s| {
            let p = 4 / G;
            let mut acc = [[_mm512_setzero_pd(); 2]; 4];
            for dd in (0..32).step_by(p) {
                for g in 0..G {
                    for c in 0..p {
                        let d = 32 * g + dd + c;
                        let (qd, kd) = (_mm512_set1_pd(q[d]), kb[d].as_ptr());
                        let a = &mut acc[g * p + c];
                        // SAFETY: kd points at LANES = 16 f64.
                        a[0] = _mm512_fmadd_pd(qd, unsafe { _mm512_loadu_pd(kd) }, a[0]);
                        a[1] = _mm512_fmadd_pd(qd, unsafe { _mm512_loadu_pd(kd.add(8)) }, a[1]);
                    }
                }
            }
            for g in 0..G {
                let mut v = acc[g * p];
                for c in 1..p {
                    v = [
                        _mm512_add_pd(v[0], acc[g * p + c][0]),
                        _mm512_add_pd(v[1], acc[g * p + c][1]),
                    ];
                }
                // SAFETY: s[g] holds LANES = 16 f64.
                unsafe {
                    _mm512_storeu_pd(s[g].as_mut_ptr(), v[0]);
                    _mm512_storeu_pd(s[g].as_mut_ptr().add(8), v[1]);
                }
            }
        })
    }

    /// Tolerance class on AVX2: the group sums as multiply and add chains, half the block
    /// (8 keys, two vectors of 4) at a time, so that the eight chains and their operands
    /// fit the 16 registers; `4 / G` chains a group as in [`tol_avx512`].
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn tol_avx2<const G: usize>(
        e: &Engine,
        r: usize,
        q_fp4: bool,
        k_fp4: bool,
        out: &mut [f32; LANES],
    ) {
        super::tolerance_block_with::<G>(e, r, q_fp4, k_fp4, out, |q, kb, s| {
            let p = 4 / G;
            for half in 0..2 {
                let mut acc = [[_mm256_setzero_pd(); 2]; 4];
                for dd in (0..32).step_by(p) {
                    for g in 0..G {
                        for c in 0..p {
                            let d = 32 * g + dd + c;
                            let qd = _mm256_set1_pd(q[d]);
                            let kd = kb[d][8 * half..].as_ptr();
                            let a = &mut acc[g * p + c];
                            // SAFETY: kd points at 8 f64.
                            let (k0, k1) =
                                unsafe { (_mm256_loadu_pd(kd), _mm256_loadu_pd(kd.add(4))) };
                            a[0] = _mm256_add_pd(a[0], _mm256_mul_pd(qd, k0));
                            a[1] = _mm256_add_pd(a[1], _mm256_mul_pd(qd, k1));
                        }
                    }
                }
                for g in 0..G {
                    let mut v = acc[g * p];
                    for c in 1..p {
                        v = [
                            _mm256_add_pd(v[0], acc[g * p + c][0]),
                            _mm256_add_pd(v[1], acc[g * p + c][1]),
                        ];
                    }
                    // SAFETY: s[g][8 half ..] holds 8 f64.
                    unsafe {
                        let o = s[g][8 * half..].as_mut_ptr();
                        _mm256_storeu_pd(o, v[0]);
                        _mm256_storeu_pd(o.add(4), v[1]);
                    }
                }
            }
        })
    }

    /// AVX-512 VNNI: one `vpdpbusd` (biased u8 keys x i8 queries, four products a lane)
    /// per (head, group word, 16 keys); the `HEAD_BLOCK * G` accumulator chains are
    /// independent, so they interleave.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2")]
    pub(super) unsafe fn block_avx512<const G: usize>(
        e: &Engine,
        r: usize,
        out: &mut [f32; LANES],
    ) {
        let kp = e.k_quads.as_ptr();
        let d4 = e.dim / 4;
        block_with::<G>(e, r, out, |q, corr, acc| {
            // SAFETY: `k_quads` holds `D/4 * LANES` words, `q` holds `HEAD_BLOCK * D/4`
            // and `corr` `HEAD_BLOCK * G`; every index below is within those.
            unsafe {
                let mut a = [[_mm512_setzero_si512(); G]; HEAD_BLOCK];
                for w in 0..8 {
                    let mut kv = [_mm512_setzero_si512(); G];
                    for (gg, k) in kv.iter_mut().enumerate() {
                        *k = _mm512_loadu_si512(kp.add((gg * 8 + w) * LANES) as *const _);
                    }
                    for (hk, ah) in a.iter_mut().enumerate() {
                        for (gg, ag) in ah.iter_mut().enumerate() {
                            let qv = _mm512_set1_epi32(*q.get_unchecked(hk * d4 + gg * 8 + w));
                            *ag = _mm512_dpbusd_epi32(*ag, kv[gg], qv);
                        }
                    }
                }
                for hk in 0..HEAD_BLOCK {
                    for gg in 0..G {
                        let c = _mm512_set1_epi32(*corr.get_unchecked(hk * G + gg));
                        let v = _mm512_sub_epi32(a[hk][gg], c);
                        _mm512_storeu_si512(acc[hk][gg].as_mut_ptr() as *mut _, v);
                    }
                }
            }
        });
    }

    /// AVX2: `vpmaddubsw` (pairs of u8 x i8 into i16, at most 576: no saturation),
    /// `vpmaddwd` by ones, `vpaddd`, on two halves of 8 keys, one head at a time.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn block_avx2<const G: usize>(e: &Engine, r: usize, out: &mut [f32; LANES]) {
        let kp = e.k_quads.as_ptr();
        let d4 = e.dim / 4;
        block_with::<G>(e, r, out, |q, corr, acc| {
            // SAFETY: as in `block_avx512`.
            unsafe {
                let ones = _mm256_set1_epi16(1);
                for (hk, acc_h) in acc.iter_mut().enumerate() {
                    let mut a = [[_mm256_setzero_si256(); 2]; G];
                    for w in 0..8 {
                        for (gg, ag) in a.iter_mut().enumerate() {
                            let i = gg * 8 + w;
                            let qv = _mm256_set1_epi32(*q.get_unchecked(hk * d4 + i));
                            let k0 = _mm256_loadu_si256(kp.add(i * LANES) as *const _);
                            let k1 = _mm256_loadu_si256(kp.add(i * LANES + 8) as *const _);
                            let p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(k0, qv), ones);
                            let p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(k1, qv), ones);
                            ag[0] = _mm256_add_epi32(ag[0], p0);
                            ag[1] = _mm256_add_epi32(ag[1], p1);
                        }
                    }
                    for gg in 0..G {
                        let c = _mm256_set1_epi32(*corr.get_unchecked(hk * G + gg));
                        let v0 = _mm256_sub_epi32(a[gg][0], c);
                        let v1 = _mm256_sub_epi32(a[gg][1], c);
                        _mm256_storeu_si256(acc_h[gg].as_mut_ptr() as *mut _, v0);
                        _mm256_storeu_si256(acc_h[gg].as_mut_ptr().add(8) as *mut _, v1);
                    }
                }
            }
        });
    }
}

/// The engine's logits for every row of `p`, rows concatenated (`f32 [sum n]`, the
/// layout of [`crate::reference::logits()`]), on `isa`, single-threaded. For tests that
/// hold the engine bitwise to the reference.
pub fn engine_logits(p: &Problem, isa: Isa) -> Vec<f32> {
    let rows = p.batch.rows();
    let mut out = vec![0f32; p.batch.valid_pairs()];
    let mut e = Engine::with_isa(p, isa);
    let mut rest: &mut [f32] = &mut out;
    let mut i = 0;
    while i < rows.len() {
        let g = (rows.len() - i).min(ROW_GROUP);
        let idx: Vec<usize> = (i..i + g).collect();
        let mut outs: Vec<&mut [f32]> = Vec::with_capacity(g);
        for &row in &idx {
            let (a, b) = std::mem::take(&mut rest).split_at_mut(rows[row].n);
            outs.push(a);
            rest = b;
        }
        e.rows(p, &idx, &mut outs);
        i += g;
    }
    out
}
