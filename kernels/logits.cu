// SPEC 4's logits on tensor cores. Four entry points; the host picks one per variant
// (cuda::kernels::logits_kernel):
// - mqa_logits: every variant on mma.sync (the fallback, and WGMMA=0);
// - mqa_logits_wgr: the exact class for H = 32, D >= 64 on fp8 wgmma with the keys in
//   registers (the default for those variants);
// - mqa_logits_w16: E4M3 x E4M3 for H = 64 on f16 wgmma (f32 accumulation);
// - mqa_logits_w8: the same on fp8 wgmma (W8=1, an A/B knob: it misses SPEC 4's bound
//   on subnormal operands, see there).
// block: one row group (<= LG_ROWS rows of one request, one warp each) x key tiles
//        c = blockIdx.x, blockIdx.x + gridDim.x, .. of LG_KEYS keys -> logits[row_off[i] + j], j < n_i.
//
// Variant macros (set by the host): DSA_H (heads), DSA_G (groups of 32 dims),
// DSA_QF, DSA_KF (0 = E4M3, 1 = E2M1).
//
// Layout: keys are the MMA's M side (16 keys per m-tile, staged through shared memory
// and fed by ldmatrix), heads its N side (8 per n-tile, the query row's fragments live
// in registers), one k=32 e4m3 step per scale group (two k=16 f16 steps in the exact
// class: sm_90 runs e4m3 mma.sync as F2FP unpacks plus f16 MMAs on every use, so the
// exact class stages f16 once instead). A lane of the m16n8 accumulator holds
// keys (gid, gid+8) x heads (2*tig, 2*tig+1), so SPEC 4's head sum P is: one add in the
// thread, a shuffle at lane offset 1, one at offset 2 (tig bits = head bits 1, 2), then
// the n-tiles pairwise in the thread.
//
// Exact class (E2M1 x E2M1): the MMA runs on doubled values (integers in [-12, 12],
// exact in f16 and in E4M3) with f32 accumulation: every product is an integer <= 144 and every
// partial sum an integer below 4608 < 2^13, so 4*s_g comes out exact in f32 in any
// summation order, even from an accumulator that keeps only 13 bits (and the tests
// check it bitwise). t_g = (s_g * 2^(eq-127)) * 2^(ek-127) is computed as
// (4 s_g * 2^(eq-129)) * 2^(ek-127): the same real products, one rounding each, so
// bitwise the reference. (An s8 MMA gives the same 4*s_g but
// needs an int->f32 conversion per group: two more epilogue ops.)
// Scale folding (exact class, SCALE_FOLD=1, the default): when a block's query group
// scales lie within 15 binades per group (eq <= 244), and a key tile's scales too, the
// operands carry the scales: a doubled E2M1 value times 2^s, s in [-9, 5], is exact in
// E4M3 (and in f16), so the MMA yields X_g = 4 s_g 2^(sq + sk) exactly (13 significant bits, as
// above), and t_g = X_g * C_g with the per-tile constant C_g = 2^(ebq_g + ebk_g - 256)
// (eq = ebq_g + sq, ek = ebk_g + sk). That is one rounding of the same real product as
// the reference's (s_g * 2^(eq-127)) * 2^(ek-127), whose first multiply is exact for
// eq <= 244: bitwise the reference, with one multiply per group instead of two and no
// per-key scale loads. A tile outside the windows (or with C_g out of f32's range) takes
// the two-multiply epilogue; its query scale is then 2^(ebq_g - 129) per group, since
// the query operands stay scaled.
// Tolerance class: e4m3 MMA with f32 accumulate (E2M1 operands converted exactly to
// E4M3). E4M3 x E4M3 chains the groups in the accumulator (every c_g is 1); a mixed
// pair takes each group's f32 MMA sum, scales it in f64 and sums the groups pairwise
// in f64, rounding once, as SPEC 4 does.

#ifndef DSA_H
#error "DSA_H must be defined by the host"
#endif
#define H DSA_H
#define G DSA_G
#define QF DSA_QF
#define KF DSA_KF
#define D (G * 32)
#define NT (H / 8)
#define EXACT (QF == 1 && KF == 1)
// Rows per block: 4 for H >= 32 (register-bound: two or three 4-warp blocks per SM beat
// one of 8 warps; benches/RESULTS.md), else 8. The host computes the same
// (kernels::logits_rows) and reads overrides of it from $DSA_CUDA_DEFINES too.
#ifndef LG_ROWS
#define LG_ROWS (H >= 32 ? 4 : 8)
#endif
#define LG_KEYS 64
#define LG_THREADS (LG_ROWS * 32)
// Blocks per SM the register allocation must allow (a tuning knob: 2 caps registers
// at 128 and spills; see benches/RESULTS.md).
#ifndef LG_MIN_BLOCKS
#define LG_MIN_BLOCKS (H == 64 ? (QF == 0 && KF == 0 ? 3 : 2) : (H == 32 && EXACT ? 2 : 1))
#endif
// Scale folding for the exact class (see above); 0 turns it off (an A/B knob).
#ifndef SCALE_FOLD
#define SCALE_FOLD 1
#endif

// Exact-class path counters, when the host passes them (src/cuda/kernels.rs mirrors the
// ids): blocks whose queries fold and blocks whose do not, once per block; threads whose
// key tiles all ran one multiply per group (folded tiles, or mqa_logits_wgr's
// one-multiply form) and threads of which some tile ran the reference's two. A flag per
// thread (a predicate, no register taken from the key loop), counted per warp at the
// end of the kernel; every thread of the block calls this.
#define LG_PATH_QFOLD 0
#define LG_PATH_QPLAIN 1
#define LG_PATH_ONE 2
#define LG_PATH_TWO 3
#define LG_PATHS 4
__device__ __forceinline__ void count_fold_paths(u32 *paths, const bool fold_q, const bool two_mul) {
  if (paths == nullptr) return;
  const u32 t = __popc(__ballot_sync(0xFFFFFFFFu, two_mul)), o = 32u - t;
  if ((threadIdx.x & 31) == 0) {
    if (o) atomicAdd(&paths[LG_PATH_ONE], o);
    if (t) atomicAdd(&paths[LG_PATH_TWO], t);
  }
  if (threadIdx.x == 0) atomicAdd(&paths[fold_q ? LG_PATH_QFOLD : LG_PATH_QPLAIN], 1u);
}
// The exact class runs f16 MMAs (m16n8k16, two per group): native on sm_90, where the
// e4m3 mma.sync is emulated by per-use F2FP unpacks to f16; doubled E2M1 values (and
// with folding, times 2^s) are exact f16. KW: k16 steps per 32-dim group in the
// fragments; EB: bytes per staged key element.
#define KW (EXACT ? 2 : 1)
#define EB (EXACT ? 2 : 1)
#define KSTRIDE (EB * D + 16)  // bytes per staged key row: ldmatrix rows in distinct banks

static_assert(H == 8 || H == 16 || H == 32 || H == 64, "H must be a power of two in 8..=64");
static_assert(G == 1 || G == 2 || G == 4, "D must be 32, 64 or 128");
static_assert(LG_KEYS % 32 == 0, "keys per block: whole pairs of 16-key m-tiles");
static_assert((KSTRIDE / 4) % 8 == 4, "key row stride must rotate banks by 4 words");

// Pairwise sum P of N values in place (N a power of two): SPEC 4's order.
template <int N>
__device__ __forceinline__ float pairwise_f32(float (&x)[N]) {
#pragma unroll
  for (int s = 1; s < N; s <<= 1)
#pragma unroll
    for (int i = 0; i < N; i += 2 * s) x[i] = __fadd_rn(x[i], x[i + s]);
  return x[0];
}
template <int N>
__device__ __forceinline__ double pairwise_f64(double (&x)[N]) {
#pragma unroll
  for (int s = 1; s < N; s <<= 1)
#pragma unroll
    for (int i = 0; i < N; i += 2 * s) x[i] = __dadd_rn(x[i], x[i + s]);
  return x[0];
}

// SPEC 4's head sum, first levels, for the accumulator fragment of one lane: a0, a1 are
// key gid at heads (2 tig, +1), a2, a3 key gid + 8. term_h = w_h * relu(a_h); the head
// pair in the thread; then head bit 1 (lane offset 1), where even lanes keep key gid
// and odd lanes key gid + 8.
__device__ __forceinline__ float head_quad(const float2 wv, const float a0, const float a1,
                                           const float a2, const float a3, const bool odd) {
  const float u0 = __fadd_rn(__fmul_rn(wv.x, relu_f32(a0)), __fmul_rn(wv.y, relu_f32(a1)));
  const float u1 = __fadd_rn(__fmul_rn(wv.x, relu_f32(a2)), __fmul_rn(wv.y, relu_f32(a3)));
  const float r1 = __shfl_xor_sync(FULL_MASK, odd ? u0 : u1, 1);
  return __fadd_rn(odd ? u1 : u0, r1);
}

// The next level, head bit 2 (lane offset 2), over two independent partial sums v0, v1
// (two m-tiles or two rows): lanes with `hi` keep v1's, the others v0's.
__device__ __forceinline__ float lane_pair_sum(const float v0, const float v1, const bool hi) {
  const float r2 = __shfl_xor_sync(FULL_MASK, hi ? v0 : v1, 2);
  return __fadd_rn(hi ? v1 : v0, r2);
}

// One key tile (keys j0 .. j0+LG_KEYS-1, staged in shared memory) for one warp's row:
// MMAs, SPEC 4's epilogue, and the row's logits out[j] for j < n. FOLD: the tile's
// scales are in the operands and cg[g] = C_g (exact class only).
template <bool FOLD>
__device__ __forceinline__ void compute_tile(const u32 j0, const u32 n, float *__restrict__ out,
                                             const u8 *skey, const float *skscale,
                                             const float *sqs, const float *sw,
                                             const u32 (&bq)[NT][G][2 * KW], const float (&cg)[G],
                                             const int lane, const int gid, const int tig,
                                             const bool odd, const bool hi) {

#pragma unroll 1
  for (int mp = 0; mp < LG_KEYS / 32; ++mp) {
    const u32 jb = j0 + mp * 32;  // keys jb .. jb+31: m-tiles 2*mp, 2*mp+1
    if (jb >= n) break;
    u32 a[2][G][KW][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int g = 0; g < G; ++g)
#pragma unroll
        for (int kw = 0; kw < KW; ++kw) {
          const int r = mp * 32 + mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
          ldmatrix_x4(a[mt][g][kw], skey + r * KSTRIDE + EB * (g * 32 + kw * 16) + (lane >> 4) * 16);
        }
    // Key-side scales of this lane's keys (gid, gid+8) in each m-tile.
    float kc[2][(KF == 1) ? G : 1][2];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int g = 0; g < ((KF == 1) ? G : 1); ++g)
#pragma unroll
        for (int r = 0; r < 2; ++r)
          kc[mt][g][r] = skscale[(mp * 32 + mt * 16 + gid + 8 * r) * ((KF == 1) ? G : 1) + g];

    float s[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const float2 wv = *reinterpret_cast<const float2 *>(&sw[nt * 8 + 2 * tig]);
      float v[2];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        // a_h for (key gid, head 2t), (gid, 2t+1), (gid+8, 2t), (gid+8, 2t+1).
        float ah[4];
#if EXACT
        float t[4][G];
#pragma unroll
        for (int g = 0; g < G; ++g) {
          float acc[4];
          mma_f16_zero(acc, a[mt][g][0], bq[nt][g][0], bq[nt][g][1]);
          mma_f16(acc, a[mt][g][1], bq[nt][g][2], bq[nt][g][3]);
          if (FOLD) {
#pragma unroll
            for (int e = 0; e < 4; ++e) t[e][g] = __fmul_rn(acc[e], cg[g]);
          } else {
            const float2 qs = *reinterpret_cast<const float2 *>(&sqs[g * H + nt * 8 + 2 * tig]);
            t[0][g] = __fmul_rn(__fmul_rn(acc[0], qs.x), kc[mt][g][0]);
            t[1][g] = __fmul_rn(__fmul_rn(acc[1], qs.y), kc[mt][g][0]);
            t[2][g] = __fmul_rn(__fmul_rn(acc[2], qs.x), kc[mt][g][1]);
            t[3][g] = __fmul_rn(__fmul_rn(acc[3], qs.y), kc[mt][g][1]);
          }
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) ah[e] = pairwise_f32<G>(t[e]);
#elif QF == 0 && KF == 0
        float acc[4];
        mma_e4m3_zero(acc, a[mt][0][0], bq[nt][0][0], bq[nt][0][1]);
#pragma unroll
        for (int g = 1; g < G; ++g) mma_e4m3(acc, a[mt][g][0], bq[nt][g][0], bq[nt][g][1]);
#pragma unroll
        for (int e = 0; e < 4; ++e) ah[e] = acc[e];
#else
        double t[4][G];
#pragma unroll
        for (int g = 0; g < G; ++g) {
          float acc[4];
          mma_e4m3_zero(acc, a[mt][g][0], bq[nt][g][0], bq[nt][g][1]);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
#if QF == 1
            const double c = (double)sqs[g * H + nt * 8 + 2 * tig + (e & 1)];
#else
            const double c = (double)kc[mt][g][e >> 1];
#endif
            t[e][g] = __dmul_rn((double)acc[e], c);
          }
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) ah[e] = __double2float_rn(pairwise_f64<G>(t[e]));
#endif
        v[mt] = head_quad(wv, ah[0], ah[1], ah[2], ah[3], odd);
      }
      s[nt] = lane_pair_sum(v[0], v[1], hi);  // lanes with tig bit 1 clear keep m-tile 0
    }
    float logit = pairwise_f32<NT>(s);
    const int kk = mp * 32 + (hi ? 16 : 0) + gid + (odd ? 8 : 0);
    if (KF == 0) logit = __fmul_rn(logit, skscale[kk]);
    // IEEE leaves a NaN's sign and payload open; the contract's NaN (the reference's and
    // the golden vectors', x86's default NaN) is 0xFFC00000. Canonicalise so that the
    // exact class is bitwise equal there too.
    if (logit != logit) logit = __uint_as_float(0xFFC00000u);
    const u32 j = j0 + kk;
    if (j < n) out[j] = logit;
  }
}

// The folding tables: thread i < 15 writes table i, the codes of the doubled E2M1
// magnitudes {0, 1, 2, 3, 4, 6, 8, 12} times 2^(i - 9) (word 0: magnitudes 0..3, word
// 1: 4..7), as f16 high bytes (F16) or E4M3 bytes; e2m1_word_tab looks codes up in them.
template <bool F16>
__device__ __forceinline__ void shift_tables(u32 (*stab)[2], const int tid) {
  if (tid < 15) {
    const u32 m[8] = {0, 1, 2, 3, 4, 6, 8, 12};
    u32 t0 = 0, t1 = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      t0 |= (F16 ? f16_exact_hi_byte(m[i], tid - 9) : e4m3_exact_byte(m[i], tid - 9)) << (8 * i);
      t1 |= (F16 ? f16_exact_hi_byte(m[i + 4], tid - 9) : e4m3_exact_byte(m[i + 4], tid - 9))
            << (8 * i);
    }
    stab[tid][0] = t0;
    stab[tid][1] = t1;
  }
}

// Scale windows for folding. Every lane holds bytes of group lane % G only (32 and the
// block size are multiples of G); values above 255 are "none". Lane 0 stores the warp's
// per-group maxima and minima as packed bytes in wmax[warp] / wmin[warp] (group g in
// byte g; unused bytes neutral: 0 for the max, 255 for the min).
__device__ __forceinline__ void warp_window(u32 mx, u32 mn, u32 *wmax, u32 *wmin,
                                            const int lane, const int warp) {
#pragma unroll
  for (int o = G; o < 32; o <<= 1) {
    mx = max(mx, __shfl_xor_sync(FULL_MASK, mx, o));
    mn = min(mn, __shfl_xor_sync(FULL_MASK, mn, o));
  }
  u32 pmax = 0u, pmin = 0xFFFFFFFFu;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    pmax |= __shfl_sync(FULL_MASK, mx, g) << (8 * g);
    pmin &= ~(0xFFu << (8 * g)) | (__shfl_sync(FULL_MASK, mn, g) << (8 * g));
  }
  if (lane == 0) {
    wmax[warp] = pmax;
    wmin[warp] = pmin;
  }
}

// warp_window of a key tile's scale bytes held by this thread (256: none).
template <int N>
__device__ __forceinline__ void key_window(const u32 (&pre_s)[N], u32 *wmax, u32 *wmin,
                                           const int lane, const int warp) {
  u32 mx = 0u, mn = 255u;
#pragma unroll
  for (int i = 0; i < N; ++i)
    if (pre_s[i] <= 255u) {
      mx = max(mx, pre_s[i]);
      mn = min(mn, pre_s[i]);
    }
  warp_window(mx, mn, wmax, wmin, lane, warp);
}

// The block's window per group from the warps' packed bytes: base[g] = the exponent the
// operands are scaled against (max(min, max - 5): shifts in [-9, 5]); false when a group
// spans more than 15 binades.
template <int NW>
__device__ __forceinline__ bool block_window(const u32 *wmax, const u32 *wmin, int (&base)[G],
                                             int (&top)[G]) {
  u32 bmax = 0u, bmin = 0xFFFFFFFFu;
#pragma unroll
  for (int w = 0; w < NW; ++w) {
    bmax = __vmaxu4(bmax, wmax[w]);
    bmin = __vminu4(bmin, wmin[w]);
  }
  bool ok = true;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const int mx = (int)((bmax >> (8 * g)) & 0xFFu), mn = (int)((bmin >> (8 * g)) & 0xFFu);
    ok = ok && mx - mn <= 14;
    base[g] = max(mn, mx - 5);
    top[g] = mx;
  }
  return ok;
}

// Whether a key tile folds (its windows hold, the block's queries fold, and every
// C_g = 2^(ebq_g + ebk_g - 256) is an f32), with kbase and cg (0 when not folding).
template <int NW>
__device__ __forceinline__ bool key_fold(const u32 *wmax, const u32 *wmin, const bool fold_q,
                                         const int (&qbase)[G], int (&kbase)[G],
                                         float (&cg)[G]) {
  int ktop[G];
  bool fold = block_window<NW>(wmax, wmin, kbase, ktop) && fold_q;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const int ce = qbase[g] + kbase[g] - 256;
    fold = fold && ce >= -149 && ce <= 127;
    cg[g] = fold ? pow2i(ce) : 0.0f;
  }
  return fold;
}

extern "C" __global__ void __launch_bounds__(LG_THREADS, LG_MIN_BLOCKS) mqa_logits(
    const u8 *__restrict__ q,        // E4M3 [T,H,D] or packed E2M1 [T,H,D/2]
    const u8 *__restrict__ q_scale,  // UE8M0 [T,H,G] (E2M1 queries)
    const u8 *__restrict__ k,        // E4M3 [L,D] or packed E2M1 [L,D/2]
    const u8 *__restrict__ k_scale8,    // UE8M0 [L,G] (E2M1 keys)
    const float *__restrict__ k_scale32,  // f32 [L] (E4M3 keys)
    const float *__restrict__ w,     // [T,H]
    const u32 *__restrict__ row_n,   // visible keys per row
    const u32 *__restrict__ row_ks,  // flat key offset per row
    const u64 *__restrict__ row_off, // row's offset (floats) in the tile buffer
    const uint4 *__restrict__ groups,  // (row0, rows, nmax, 0) per row group
    u32 group0, float *__restrict__ logits,
    u32 *__restrict__ paths) {  // exact-class folding counters (LG_PATH_*), or null
  // E4M3 keys arrive by cp.async into two buffers (the next tile lands while this one
  // is computed); E2M1 keys are prefetched into registers and decoded into buffer 0.
  constexpr int NBUF = (KF == 1) ? 1 : 2;
  __shared__ __align__(16) u8 skey[NBUF][LG_KEYS * KSTRIDE];
  // Key scales: E2M1 keys 2^(e-127) per (key, group); E4M3 keys the per-key scale.
  __shared__ __align__(16) float skscale[NBUF][LG_KEYS * (KF == 1 ? G : 1)];
  // Per warp (row): query group scales [G][H] and weights [H].
  __shared__ __align__(8) float sqs[LG_ROWS][(QF == 1 ? G : 1) * H];
  __shared__ __align__(8) float sw[LG_ROWS][H];
#if EXACT
  // f16 high bytes (magnitudes 0..3, 4..7) of the doubled E2M1 magnitudes times 2^(i - 9).
  __shared__ u32 stab[15][2];
  // Per warp: packed per-group maxima / minima of the query scales, and of a key tile's.
  __shared__ u32 swq[2][LG_ROWS], swk[2][LG_ROWS];
#endif

  const uint4 grp = groups[group0 + blockIdx.y];
  const u32 nchunks = (grp.z + LG_KEYS - 1) / LG_KEYS;
  if (blockIdx.x >= nchunks) return;  // whole block past the group's longest row
  const u32 ks = row_ks[grp.x];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gid = lane >> 2, tig = lane & 3;

  // ---- this warp's query row: weights, scales and MMA B fragments, loaded once ----
  const bool active = (u32)warp < grp.y;
  const u32 row = grp.x + (active ? warp : 0);
  const u32 n = active ? row_n[row] : 0u;
  for (int h = lane; h < H; h += 32) sw[warp][h] = w[(u64)row * H + h];
#if EXACT
  shift_tables<true>(stab, tid);
  {
    u32 mx = 0u, mn = 255u;
    for (int t = lane; t < H * G; t += 32) {
      const u32 e = q_scale[(u64)row * H * G + t];
      mx = max(mx, e);
      mn = min(mn, e);
    }
    warp_window(mx, mn, swq[0], swq[1], lane, warp);
  }
  __syncthreads();
  int qbase[G], qtop[G];
  bool fold_q = block_window<LG_ROWS>(swq[0], swq[1], qbase, qtop) && SCALE_FOLD;
#pragma unroll
  for (int g = 0; g < G; ++g) fold_q = fold_q && qtop[g] <= 244;
#endif
  if (QF == 1) {
    for (int t = lane; t < H * G; t += 32) {
      const int h = t / G, g = t % G;
      // Exact class folds the 1/4 of 4*s_g into the query scale (a power of two: exact).
#if EXACT
      // With the operands scaled, the query scale left is 2^(ebq_g - 129) per group.
      sqs[warp][g * H + h] = fold_q ? pow2i(qbase[g] - 129)
                                    : ue8m0_pow2(q_scale[(u64)row * H * G + t], 2);
#else
      sqs[warp][g * H + h] = ue8m0_pow2(q_scale[(u64)row * H * G + t], EXACT ? 2 : 0);
#endif
    }
  }
  u32 bq[NT][G][2 * KW];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int h = nt * 8 + gid;
#pragma unroll
    for (int g = 0; g < G; ++g) {
#if EXACT
      // f16 B fragments of m16n8k16: b{2kw + half} holds dims g*32 + 16kw + 8half + 2tig, +1
      // (one packed byte), times 2^(eq - ebq_g) when the block folds.
      const int sh = fold_q ? (int)q_scale[((u64)row * H + h) * G + g] - qbase[g] : 0;
      const u32 t0 = stab[sh + 9][0], t1 = stab[sh + 9][1];
#pragma unroll
      for (int i = 0; i < 4; ++i)
        bq[nt][g][i] = e2m1_pair_f16(
            q[((u64)row * H + h) * (D / 2) + (g * 32 + (i >> 1) * 16 + (i & 1) * 8 + 2 * tig) / 2],
            t0, t1);
#else
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int d = g * 32 + half * 16 + tig * 4;
        u32 v;
        if (QF == 1) {
          const u16 two = *reinterpret_cast<const u16 *>(q + ((u64)row * H + h) * (D / 2) + d / 2);
          u32 unused;
          e2m1_word(two, v, unused);
        } else {
          v = *reinterpret_cast<const u32 *>(q + ((u64)row * H + h) * D + d);
        }
        bq[nt][g][half] = v;
      }
#endif
    }
  }

  // ---- key tiles: this block's chunks blockIdx.x, + gridDim.x, ...; the next tile's
  // global loads are in flight while the current one is computed ----
  constexpr int KV = (KF == 1) ? G : 2 * G;  // 16-byte pieces per key
  constexpr int PRE = (KF == 1) ? (LG_KEYS * KV + LG_THREADS - 1) / LG_THREADS : 1;
  constexpr int NS = LG_KEYS * ((KF == 1) ? G : 1);  // key-side scales per tile
  constexpr int PRE_S = (KF == 1) ? (NS + LG_THREADS - 1) / LG_THREADS : 1;
  uint4 pre[PRE];
#if EXACT
  u32 pre_s[PRE_S];  // raw UE8M0 bytes (256: none)
#else
  float pre_s[PRE_S];
#endif
  // E2M1: global -> registers.
  auto prefetch = [&](u32 c) {
    const u32 j0 = c * LG_KEYS;
    const u32 nk = min((u32)LG_KEYS, grp.z - j0);
#pragma unroll
    for (int i = 0; i < PRE; ++i) {
      const int t = tid + i * LG_THREADS;
      const int kk = t / KV, p = t % KV;
      pre[i] = make_uint4(0, 0, 0, 0);
      if (t < LG_KEYS * KV && (u32)kk < nk)
        pre[i] = *reinterpret_cast<const uint4 *>(k + (u64)(ks + j0 + kk) * (KV * 16) + p * 16);
    }
#pragma unroll
    for (int i = 0; i < PRE_S; ++i) {
      const int t = tid + i * LG_THREADS;
#if EXACT
      pre_s[i] = 256u;  // "none" for the window: a key past the group's
      if (t < NS && (u32)(t / G) < nk) pre_s[i] = k_scale8[(u64)(ks + j0) * G + t];
#else
      pre_s[i] = 0.0f;
      if (t < NS && (u32)(t / G) < nk) pre_s[i] = ue8m0_pow2(k_scale8[(u64)(ks + j0) * G + t], 0);
#endif
    }
  };
  // E4M3: global -> shared buffer `buf` directly, zero-filled past the group's keys.
  auto issue = [&](u32 c, int buf) {
    const u32 j0 = c * LG_KEYS;
    const u32 nk = min((u32)LG_KEYS, grp.z - j0);
    for (int t = tid; t < LG_KEYS * KV; t += LG_THREADS) {
      const int kk = t / KV, p = t % KV;
      const bool ok = (u32)kk < nk;
      cp_async16(&skey[buf][kk * KSTRIDE + p * 16],
                 k + (u64)(ks + j0 + (ok ? kk : 0)) * (KV * 16) + p * 16, ok ? 16u : 0u);
    }
    for (int t = tid; t < LG_KEYS; t += LG_THREADS) {
      const bool ok = (u32)t < nk;
      cp_async4(&skscale[buf][t], k_scale32 + ks + j0 + (ok ? t : 0), ok ? 4u : 0u);
    }
    cp_async_commit();
  };
  const bool odd = (tig & 1) != 0, hi = (tig & 2) != 0;
  if (KF == 1) prefetch(blockIdx.x);
  else issue(blockIdx.x, 0);
  int buf = 0;
  // Folding state of the current tile (always off outside the exact class).
  bool fold = false;
  bool two_mul = false;  // some tile of this thread's ran unfolded
  float cg[G];
#pragma unroll
  for (int g = 0; g < G; ++g) cg[g] = 0.0f;
#if EXACT
  int kbase[G];
#endif
  for (u32 c = blockIdx.x; c < nchunks; c += gridDim.x) {
    const u32 j0 = c * LG_KEYS;
    const bool more = c + gridDim.x < nchunks;
    if (KF == 1) {
#if EXACT
      // This tile's key-scale window; fold when it and the block's query window hold
      // and every C_g is an f32.
      key_window(pre_s, swk[0], swk[1], lane, warp);
      __syncthreads();
      fold = key_fold<LG_ROWS>(swk[0], swk[1], fold_q, qbase, kbase, cg);
#endif
      // Stage: E2M1 decoded once per block (doubled E4M3 bytes; folded: times 2^sk).
#pragma unroll
      for (int i = 0; i < PRE; ++i) {
        const int t = tid + i * LG_THREADS;
        if (t < LG_KEYS * KV) {
          const int kk = t / KV, p = t % KV;
#if EXACT
          // Piece p is group p of key kk: its scale is pre_s[i] (same t).
          const int sh = (fold && pre_s[i] <= 255u) ? (int)pre_s[i] - kbase[p] : 0;
          const u32 t0 = stab[sh + 9][0], t1 = stab[sh + 9][1];
          // 32 codes -> 32 f16 (64 bytes): the table gives each code's f16 high byte
          // (sign in bit 7), a byte permute interleaves the zero low bytes.
          const u32 words[4] = {pre[i].x, pre[i].y, pre[i].z, pre[i].w};
#pragma unroll
          for (int wi = 0; wi < 4; ++wi) {
            u32 lo, hb;
            e2m1_word_tab(words[wi], t0, t1, lo, hb);
            *reinterpret_cast<uint4 *>(&skey[0][kk * KSTRIDE + p * 64 + wi * 16]) =
                make_uint4(__byte_perm(lo, 0u, 0x1404), __byte_perm(lo, 0u, 0x3424),
                           __byte_perm(hb, 0u, 0x1404), __byte_perm(hb, 0u, 0x3424));
          }
#else
          uint4 a, b;
          e2m1_word(pre[i].x, a.x, a.y);
          e2m1_word(pre[i].y, a.z, a.w);
          e2m1_word(pre[i].z, b.x, b.y);
          e2m1_word(pre[i].w, b.z, b.w);
          *reinterpret_cast<uint4 *>(&skey[0][kk * KSTRIDE + p * 32]) = a;
          *reinterpret_cast<uint4 *>(&skey[0][kk * KSTRIDE + p * 32 + 16]) = b;
#endif
        }
      }
#pragma unroll
      for (int i = 0; i < PRE_S; ++i) {
        const int t = tid + i * LG_THREADS;
#if EXACT
        if (t < NS) skscale[0][t] = pre_s[i] <= 255u ? ue8m0_pow2(pre_s[i], 0) : 0.0f;
#else
        if (t < NS) skscale[0][t] = pre_s[i];
#endif
      }
      __syncthreads();
      if (more) prefetch(c + gridDim.x);
    } else {
      if (more) {
        issue(c + gridDim.x, buf ^ 1);
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();
    }
    if (active && j0 < n) {
      two_mul = two_mul || !fold;
      if (fold)
        compute_tile<true>(j0, n, logits + row_off[row], skey[buf], skscale[buf], sqs[warp],
                           sw[warp], bq, cg, lane, gid, tig, odd, hi);
      else
        compute_tile<false>(j0, n, logits + row_off[row], skey[buf], skscale[buf], sqs[warp],
                            sw[warp], bq, cg, lane, gid, tig, odd, hi);
    }
    __syncthreads();
    if (KF == 0) buf ^= 1;
  }
#if EXACT
  count_fold_paths(paths, fold_q, two_mul);
#endif
}

// term_h = w_h * relu(a_h) and SPEC 4's pairwise head sum over a warpgroup's tile of
// two rows (sw[0], sw[1]) x 8 NTL heads, a[i] for i = 4j + 2kk + e (row j / NTL, head
// 8 (j % NTL) + 2 tig + e; key 16 warp + gid + 8 kk): heads (2 tig, +1) in the thread
// (head_quad), lane offset 1 (even lanes keep key gid, odd gid + 8), lane offset 2 (lanes
// with tig bit 1 keep row 1), then the NTL n-tiles pairwise in the thread. Used by
// mqa_logits_wgr.
template <int NTL>
__device__ __forceinline__ float two_row_head_sum(const float (&a)[8 * NTL], const float (*sw)[H],
                                                  const int tig, const bool odd, const bool hi) {
  float s[NTL];
#pragma unroll
  for (int nt = 0; nt < NTL; ++nt) {
    const float2 w0 = *reinterpret_cast<const float2 *>(&sw[0][nt * 8 + 2 * tig]);
    const float2 w1 = *reinterpret_cast<const float2 *>(&sw[1][nt * 8 + 2 * tig]);
    const int i0 = 4 * nt, i1 = 4 * (NTL + nt);
    const float v0 = head_quad(w0, a[i0], a[i0 + 1], a[i0 + 2], a[i0 + 3], odd);
    const float v1 = head_quad(w1, a[i1], a[i1 + 1], a[i1 + 2], a[i1 + 3], odd);
    s[nt] = lane_pair_sum(v0, v1, hi);  // lanes with tig bit 1 clear keep row 0
  }
  return pairwise_f32<NTL>(s);
}

// Stores a wgmma kernel's logit of row r of the group (if the group has it) and key
// j = jg (+ 8 on odd lanes, after the head sum) if the row sees it, a NaN as the
// contract's 0xFFC00000.
__device__ __forceinline__ void store_logit(float *__restrict__ logits, const u64 *row_off,
                                            const u32 *row_n, const uint4 grp, const u32 r,
                                            const u32 jg, const bool odd, float logit) {
  if (logit != logit) logit = __uint_as_float(0xFFC00000u);
  if (r < grp.y) {
    const u32 row = grp.x + r;
    const u32 j = jg + (odd ? 8 : 0);
    if (j < row_n[row]) logits[row_off[row] + j] = logit;
  }
}

// wgmma operands in shared memory (no swizzle, K-major): byte offset of 16-byte chunk kc of row m in a wgmma operand of `rows` rows.
__device__ __forceinline__ u32 wg_off(u32 m, u32 kc, u32 rows) {
  return kc * (rows / 8) * 128 + (m / 8) * 128 + (m % 8) * 16;
}

#if EXACT && H == 32 && G >= 2
// ---- mqa_logits_wgr: the exact class for H = 32 on fp8 wgmma, keys in registers -----
// block: one warpgroup (128 threads), WG_ROWS = 2 rows of one request (N = 64 columns:
// row r, head h at column 32r + h), x key tiles of 64 (M) keys: c = blockIdx.x,
// blockIdx.x + gridDim.x, ... One m64n64k32 e4m3 wgmma per group g gives X_g for the
// tile (fresh accumulator: no chained groups), from doubled E2M1 values (the queries
// times 2^s when folding, as above), exact in E4M3. Every product is an integer times
// 2^sq and every partial sum below 2^13 of that unit, so X_g is exact even from an
// accumulator that keeps only 13 bits per addition, which is what the bitwise tests
// hold it to. The epilogue is compute_tile's, with the two rows in the place of its two
// m-tiles. B's layout (wgmma's no-swizzle K-major canonical form): 16-byte chunk kc of
// row m at wg_off(m, kc, rows).
#define WG_ROWS 2
#define WG_N (WG_ROWS * H)
#define WG_KEYS 64
static_assert(WG_N == 64, "one m64n64 tile per group");

// The start of mqa_logits_wgr for a block of ROWS rows and
// THREADS threads: the rows' weights into sw, the folding tables into stab, the block's
// query-scale window (whether its queries fold, the exponents qbase_g their operands are
// scaled against) and the query scales sqs (2^(ebq_g - 129) when folding, else
// 2^(eq - 129)). One barrier, after which stab and the window are visible.
template <int ROWS, int THREADS, class RowOf>
__device__ __forceinline__ bool wg_prologue(const u8 *q_scale, const float *w, RowOf row_of,
                                            float (*sw)[H], float (*sqs)[G * H],
                                            u32 (*stab)[2], u32 *swq_max, u32 *swq_min,
                                            int (&qbase)[G], const int tid, const int lane,
                                            const int warp) {
  for (int t = tid; t < ROWS * H; t += THREADS) sw[t / H][t % H] = w[(u64)row_of(t / H) * H + t % H];
  shift_tables<false>(stab, tid);
  {
    u32 mx = 0u, mn = 255u;
    for (int t = tid; t < ROWS * H * G; t += THREADS) {
      const u32 e = q_scale[(u64)row_of(t / (H * G)) * H * G + t % (H * G)];
      mx = max(mx, e);
      mn = min(mn, e);
    }
    warp_window(mx, mn, swq_max, swq_min, lane, warp);
  }
  __syncthreads();
  int qtop[G];
  bool fold_q = block_window<THREADS / 32>(swq_max, swq_min, qbase, qtop) && SCALE_FOLD;
#pragma unroll
  for (int g = 0; g < G; ++g) fold_q = fold_q && qtop[g] <= 244;
  for (int t = tid; t < ROWS * H * G; t += THREADS) {
    const int r = t / (H * G), h = (t % (H * G)) / G, g = t % G;
    sqs[r][g * H + h] = fold_q ? pow2i(qbase[g] - 129)
                               : ue8m0_pow2(q_scale[(u64)row_of(r) * H * G + h * G + g], 2);
  }
  return fold_q;
}

// The keys go from global memory straight into
// each warp's A fragments (fp8 wgmma takes A from registers), so the key loop has no
// shared memory and no barrier. Dims are permuted as in mqa_logits_w16: in group g,
// thread tig of a quad takes dims 32 g + 8 tig + e (one u32 of 8 codes) as k = 4 tig + e
// (e < 4) and k = 12 + 4 tig + e (e >= 4) of the group's k32 step, and B is staged in
// the same order. Keys are not folded into the operands: where the queries fold, each
// group takes one multiply by the key's own power of two (below), which costs less
// than a per-tile key window and a shifted decode in the key loop.

// The tile's t_g and SPEC 4's pairwise group sum from A fragments af[g] in registers
// (X_g: key 16 warp + gid + 8 kk, column 8j + 2 tig + e, a[i] for i = 4j + 2 kk + e). `one` (per thread: the MMAs are outside the branch, so warps and
// lanes may differ): t_g = X_g * cf[kk][g], one multiply by a power of two; else
// t_g = (X_g * qs) * kc, qs per row and head from shared memory and kc from esc[kk], the
// packed scale bytes of this thread's keys (0 for keys past the group's, whose
// products are 0).
__device__ __forceinline__ void wgr_group_sums(float (&a)[32], const u32 (&af)[G][4],
                                               const u8 *sB, const bool one, const bool fx,
                                               const float (&cf)[2][G],
                                               const float (*sqs)[G * H],
                                               const u32 (&esc)[2], const int tig) {
  constexpr u32 lbo = (WG_N / 8) * 128;
  float x0[32], x1[32];
#pragma unroll
  for (int g2 = 0; g2 < G; g2 += 2) {
    wgmma_fence();
    wgmma_m64n64k32_e4m3_rs(x0, af[g2], wgmma_desc(sB + 2 * g2 * lbo, lbo, 128));
    wgmma_m64n64k32_e4m3_rs(x1, af[g2 + 1], wgmma_desc(sB + 2 * (g2 + 1) * lbo, lbo, 128));
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(x0);
    fence_regs(x1);
    if (one && fx) {
      // X_g * C exact for the even groups (fx): t_g + t_(g+1) as one fma.
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        const int kk = (i >> 1) & 1;
        const float p = __fmaf_rn(x0[i], cf[kk][g2], __fmul_rn(x1[i], cf[kk][g2 + 1]));
        a[i] = g2 == 0 ? p : __fadd_rn(a[i], p);
      }
    } else if (one) {
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        const int kk = (i >> 1) & 1;
        const float p = __fadd_rn(__fmul_rn(x0[i], cf[kk][g2]), __fmul_rn(x1[i], cf[kk][g2 + 1]));
        a[i] = g2 == 0 ? p : __fadd_rn(a[i], p);
      }
    } else {
      auto scaled = [&](float x, int g, int i) -> float {
        const int j = i >> 2, kk = (i >> 1) & 1, e = i & 1;
        const int r = j >> 2, h = (j & 3) * 8 + 2 * tig + e;
        return __fmul_rn(__fmul_rn(x, sqs[r][g * H + h]),
                         ue8m0_pow2((esc[kk] >> (8 * g)) & 0xFFu, 0));
      };
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        const float p = __fadd_rn(scaled(x0[i], g2, i), scaled(x1[i], g2 + 1, i));
        a[i] = g2 == 0 ? p : __fadd_rn(a[i], p);
      }
    }
  }
}

#ifndef WGR_MIN_BLOCKS
#define WGR_MIN_BLOCKS 4
#endif
extern "C" __global__ void __launch_bounds__(128, WGR_MIN_BLOCKS) mqa_logits_wgr(
    const u8 *__restrict__ q, const u8 *__restrict__ q_scale, const u8 *__restrict__ k,
    const u8 *__restrict__ k_scale8, const float *__restrict__ k_scale32,
    const float *__restrict__ w, const u32 *__restrict__ row_n, const u32 *__restrict__ row_ks,
    const u64 *__restrict__ row_off, const uint4 *__restrict__ groups, u32 group0,
    float *__restrict__ logits, u32 *__restrict__ paths) {
  __shared__ __align__(128) u8 sB[WG_N * D];
  __shared__ __align__(8) float sqs[WG_ROWS][G * H];
  __shared__ __align__(8) float sw[WG_ROWS][H];
  __shared__ u32 stab[15][2];
  __shared__ u32 swq[2][4];

  const uint4 grp = groups[group0 + blockIdx.y];
  const u32 nchunks = (grp.z + WG_KEYS - 1) / WG_KEYS;
  if (blockIdx.x >= nchunks) return;
  const u32 ks = row_ks[grp.x];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gid = lane >> 2, tig = lane & 3;
  const bool odd = (tig & 1) != 0, hi = (tig & 2) != 0;
  auto row_of = [&](u32 r) { return grp.x + min(r, grp.y - 1); };

  int qbase[G];
  const bool fold_q = wg_prologue<WG_ROWS, 128>(q_scale, w, row_of, sw, sqs, stab, swq[0],
                                                swq[1], qbase, tid, lane, warp);
  // A block whose folded query bases all lie in [107, 129] skips the per-key check that
  // C is an f32: it is, for every scale byte 0..254 (the one-multiply form below).
  bool qsafe = fold_q;
#pragma unroll
  for (int g = 0; g < G; ++g) qsafe = qsafe && qbase[g] >= 107 && qbase[g] <= 129;
  // B: column n (row n / H, head n % H), group g: the word of dims 32 g + 8 tt .. + 7
  // -> bytes 4 tt of chunk 2 g (dims + 0..3) and of chunk 2 g + 1 (dims + 4..7).
  for (int t = tid; t < WG_N * G * 4; t += 128) {
    const int n = t / (G * 4), g = (t / 4) % G, tt = t % 4;
    const u64 qrow = (u64)row_of(n / H) * H + n % H;
    const int sh = fold_q ? (int)q_scale[qrow * G + g] - qbase[g] : 0;
    const u32 word = *reinterpret_cast<const u32 *>(q + qrow * (D / 2) + 16 * g + 4 * tt);
    u32 lo, hb;
    e2m1_word_tab(word, stab[sh + 9][0], stab[sh + 9][1], lo, hb);
    *reinterpret_cast<u32 *>(&sB[wg_off(n, 2 * g, WG_N) + 4 * tt]) = lo;
    *reinterpret_cast<u32 *>(&sB[wg_off(n, 2 * g + 1, WG_N) + 4 * tt]) = hb;
  }
  fence_proxy_async();
  __syncthreads();

  // This thread's keys in a tile: 16 warp + gid + 8 kk. Codes: one word per group;
  // scale bytes packed (group g in byte g); `none`: past the group's keys.
  u32 raw[2][G], rsc[2];
  bool none[2];
  // The scale bytes of a key in one load (G = 4: u32, G = 2: u16) when k_scale8 is
  // G-byte aligned (a uniform branch: always for the host backend's uploads), else byte
  // by byte (the engine's device inputs may start anywhere).
  const bool sc_word = (G == 4 || G == 2) &&
                       (reinterpret_cast<size_t>(k_scale8) & (size_t)(G - 1)) == 0;
  constexpr u32 none_sc = G == 4 ? 0x7F7F7F7Fu : G == 2 ? 0x7F7Fu : 0x7Fu;
  auto prefetch = [&](u32 c) {
    const u32 j = c * WG_KEYS + 16 * warp + gid;  // key kk = 0; kk = 1 is j + 8
    const u8 *kp = k + (u64)(ks + j) * (D / 2) + 4 * tig;
    const u8 *sp = k_scale8 + (u64)(ks + j) * G;
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      none[kk] = j + 8 * kk >= grp.z;
      // A key past the group's: scale bytes 127 (2^0; see the one-multiply form below).
      rsc[kk] = none_sc;
      if (!none[kk]) {
        if (sc_word) {
          rsc[kk] = G == 4 ? *reinterpret_cast<const u32 *>(sp + 8 * kk * G)
                           : (u32)*reinterpret_cast<const unsigned short *>(sp + 8 * kk * G);
        } else {
          rsc[kk] = 0u;
#pragma unroll
          for (int g = 0; g < G; ++g) rsc[kk] |= (u32)sp[8 * kk * G + g] << (8 * g);
        }
      }
#pragma unroll
      for (int g = 0; g < G; ++g)
        raw[kk][g] = none[kk] ? 0u : *reinterpret_cast<const u32 *>(kp + 8 * kk * (D / 2) + 16 * g);
    }
  };
  prefetch(blockIdx.x);
  bool two_mul = false;  // some tile ran the two multiplies
  for (u32 c = blockIdx.x; c < nchunks; c += gridDim.x) {
    const u32 j0 = c * WG_KEYS;
    u32 af[G][4];
    const u32 esc[2] = {rsc[0], rsc[1]};
    // One multiply per group when the queries fold, by C = 2^(ebq_g - 129) * 2^(ek - 127),
    // this key's: X_g * 2^(ebq_g - 129) is
    // exact (qtop <= 244 keeps it finite, and every multiple of 2^-149 with 13
    // significant bits is an f32), so rounding X_g * C once is rounding the reference's
    // exact first product times 2^(ek - 127): bitwise. A key whose C is no f32 takes
    // both multiplies (for the thread's tile).
    bool one = fold_q;
    float cf[2][G];
    // C = qf_g * 2^(ek - 127), qf_g = 2^(ebq_g - 129) (sqs's value for every row and head
    // when the queries fold): a product of two powers of two, exact when C >= 2^-149 and
    // finite, and 0 or inf exactly when it is not. A key past the group's has zero
    // products and is never stored; its scale bytes are 127 (C = qf_g, an f32), so that
    // it does not send the thread to the two-multiply form. C = 2^(ebq_g + ek - 256)
    // (ek = 0 too: 2^-127), an f32 for every ek in 0..254 when 107 <= ebq_g <= 129: such
    // a block (qsafe) skips the check.
#pragma unroll
    for (int kk = 0; kk < 2; ++kk)
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const u32 e = (rsc[kk] >> (8 * g)) & 0xFFu;
        const float c = __fmul_rn(sqs[0][g * H], __uint_as_float(e ? e << 23 : 0x00400000u));
        cf[kk][g] = c;
      }
    if (!qsafe) {
#pragma unroll
      for (int kk = 0; kk < 2; ++kk)
#pragma unroll
        for (int g = 0; g < G; ++g)
          one = one && cf[kk][g] != 0.0f && cf[kk][g] < __uint_as_float(0x7F800000u);
    }
    two_mul = two_mul || !one;
    // fx: t_g + t_(g+1) = fma(X_g, C_g, t_(g+1)) is bitwise the rounded sum of the
    // rounded products when X_g * C_g is exact. X_g = 4 s_g 2^sq = M 2^sq (the queries
    // fold: sq in [-9, 5], M an integer below 2^13 in magnitude), so for a power of two
    // C_g in [2^-140, 2^109] the product M 2^(sq + c) is an f32: a multiple of 2^-149
    // with at most 13 significant bits, below 2^127. (C_g's full range, [2^-149, 2^127]
    // or 0 or inf, is wider: a thread whose tile has a key with such a C takes the
    // multiply and the add.)
    bool fx = true;
#pragma unroll
    for (int kk = 0; kk < 2; ++kk)
#pragma unroll
      for (int g = 0; g < G; g += 2)
        fx = fx && cf[kk][g] >= __uint_as_float(0x00000200u) &&  // 2^-140 (subnormal)
             cf[kk][g] <= __uint_as_float(0x76000000u);           // 2^109
#pragma unroll
    for (int kk = 0; kk < 2; ++kk)
#pragma unroll
      for (int g = 0; g < G; ++g)
        e2m1_word_tab(raw[kk][g], stab[9][0], stab[9][1], af[g][kk], af[g][2 + kk]);
    if (c + gridDim.x < nchunks) prefetch(c + gridDim.x);

    float a[32];
    wgr_group_sums(a, af, sB, one, fx, cf, sqs, esc, tig);
    const float logit = two_row_head_sum<4>(a, sw, tig, odd, hi);
    store_logit(logits, row_off, row_n, grp, hi ? 1u : 0u, j0 + 16 * warp + gid, odd, logit);
  }
  count_fold_paths(paths, fold_q, two_mul);
}
#endif

#if QF == 0 && KF == 0 && H == 64
// ---- mqa_logits_w16: E4M3 x E4M3 with H = 64 on wgmma, f16 operands ------------------
// block: one warpgroup, W16_ROWS = 2 rows of one request (N = 128 columns: row r, head h
// at column 64 r + h) x key tiles of 64 (M) keys: c = blockIdx.x, blockIdx.x +
// gridDim.x, ... Per tile, D / 16 chained m64n128k16 f16 wgmmas with f32 accumulation.
//
// Why f16 here: every E4M3 value is exact in f16 and every product exact in f32, so the
// error is that of f32 accumulation, as on the mma.sync path (the stated 2^-16 M bound,
// cuda::TOLERANCE_LOG2); fp8 wgmma keeps about 13 bits per addition (../shared/GPU.md's
// probe), which no bound near 2^-16 M survives, and on subnormal operands not even SPEC
// 4's 2^-8 M (mqa_logits_w8, the W8=1 knob).
//
// A (keys) comes from registers, in the mma.sync m16n8k16 A fragment of each warp's 16
// keys: no shared memory and no barrier for keys. The dot product does not care in which
// order the dims are paired, so the fragments use a permuted dim order in which thread
// tig of a quad reads D / 4 contiguous bytes of each key (dims (D/4) tig + 4 s + e, e =
// 0..3, are k = 2 tig + e (e < 2) and 2 tig + 6 + e (e >= 2) of k16 step s), and B (the
// queries, staged once per block) uses the same order. E4M3 -> f16 by cvt (exact).
// The epilogue: the tolerance class's head sum of the two rows (tol_lane_heads,
// tol_quad_sum), then the key scale.
#define W16_ROWS 2
#define W16_N (W16_ROWS * H)
#define W16_KEYS 64
#define W16_S (D / 16)   // k16 steps per tile
// Blocks per SM the registers must allow. A/B on v32-16k in one call (benches/RESULTS.md
// v7): 3 (134 registers) 4.75 ms, 4 (128, no spills) 4.36 ms of logits.
#ifndef W16_MIN_BLOCKS
#define W16_MIN_BLOCKS 4
#endif
static_assert(W16_N == 128, "one m64n128 tile per k16 step");
// The tolerance class's head sum for H = 64 on wgmma (mqa_logits_w16, mqa_logits_w8),
// in the cheapest order its bound allows (cuda::TOLERANCE_LOG2's derivation): one fma
// per term in the thread, then two transposed shuffle steps, about 90 instructions per
// tile fewer than SPEC 4's order. This lane's 16 heads of row r
// (columns 8 nt + 2 tig + e of sums a[4 nt + 2 kk + e]) summed in the thread, one fma
// per term, for its two keys kk = 0, 1; then tol_quad_sum adds the quad's four lanes.
__device__ __forceinline__ void tol_lane_heads(const float *a, const float *swr, const int tig,
                                              float &p0, float &p1) {
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    const float2 wv = *reinterpret_cast<const float2 *>(&swr[nt * 8 + 2 * tig]);
    if (nt == 0) {
      p0 = __fmul_rn(wv.x, relu_f32(a[0]));
      p1 = __fmul_rn(wv.x, relu_f32(a[2]));
    } else {
      p0 = __fmaf_rn(wv.x, relu_f32(a[4 * nt]), p0);
      p1 = __fmaf_rn(wv.x, relu_f32(a[4 * nt + 2]), p1);
    }
    p0 = __fmaf_rn(wv.y, relu_f32(a[4 * nt + 1]), p0);
    p1 = __fmaf_rn(wv.y, relu_f32(a[4 * nt + 3]), p1);
  }
}
// The quad's sum of the lane partials p[r][kk], transposed: after lane offset 1 a lane
// holds key kk = odd of both rows, after offset 2 row hi: the lane's logit is row hi,
// key gid + 8 kk (store_logit's).
__device__ __forceinline__ float tol_quad_sum(const float p00, const float p01, const float p10,
                                             const float p11, const bool odd, const bool hi) {
  const float q0 = __fadd_rn(odd ? p01 : p00, __shfl_xor_sync(FULL_MASK, odd ? p00 : p01, 1));
  const float q1 = __fadd_rn(odd ? p11 : p10, __shfl_xor_sync(FULL_MASK, odd ? p10 : p11, 1));
  return __fadd_rn(hi ? q1 : q0, __shfl_xor_sync(FULL_MASK, hi ? q0 : q1, 2));
}

// The W16_S words of one key (or query head) row this thread's fragments take: bytes
// (D / 4) tig .. + D / 4.
__device__ __forceinline__ void w16_load(u32 (&x)[W16_S], const u8 *row, const int tig) {
  const u8 *p = row + (D / 4) * tig;
#if G == 4
  const uint4 a = *reinterpret_cast<const uint4 *>(p), b = *reinterpret_cast<const uint4 *>(p + 16);
  x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w; x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
#elif G == 2
  const uint4 a = *reinterpret_cast<const uint4 *>(p);
  x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
#else
  const uint2 a = *reinterpret_cast<const uint2 *>(p);
  x[0] = a.x; x[1] = a.y;
#endif
}

// This thread's two keys of key tile c (16 warp + gid, + 8) for mqa_logits_w16 and
// mqa_logits_w8: their bytes (w16_load) and scales, zeros past the group's nkeys keys.
__device__ __forceinline__ void w16_keys(u32 (&raw)[2][W16_S], float (&ksc)[2], const u8 *k,
                                         const float *k_scale32, const u32 ks, const u32 nkeys,
                                         const u32 c, const int warp, const int gid,
                                         const int tig) {
#pragma unroll
  for (int kk = 0; kk < 2; ++kk) {
    const u32 j = c * W16_KEYS + 16 * warp + gid + 8 * kk;
    if (j < nkeys) {
      w16_load(raw[kk], k + (u64)(ks + j) * D, tig);
      ksc[kk] = k_scale32[ks + j];
    } else {
#pragma unroll
      for (int s = 0; s < W16_S; ++s) raw[kk][s] = 0u;
      ksc[kk] = 0.0f;
    }
  }
}

extern "C" __global__ void __launch_bounds__(128, W16_MIN_BLOCKS) mqa_logits_w16(
    const u8 *__restrict__ q, const u8 *__restrict__ q_scale, const u8 *__restrict__ k,
    const u8 *__restrict__ k_scale8, const float *__restrict__ k_scale32,
    const float *__restrict__ w, const u32 *__restrict__ row_n, const u32 *__restrict__ row_ks,
    const u64 *__restrict__ row_off, const uint4 *__restrict__ groups, u32 group0,
    float *__restrict__ logits, u32 *__restrict__ paths) {
  __shared__ __align__(128) u8 sB[W16_N * D * 2];
  __shared__ __align__(8) float sw[W16_ROWS][H];

  const uint4 grp = groups[group0 + blockIdx.y];
  const u32 nchunks = (grp.z + W16_KEYS - 1) / W16_KEYS;
  if (blockIdx.x >= nchunks) return;
  const u32 ks = row_ks[grp.x];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gid = lane >> 2, tig = lane & 3;
  const bool odd = (tig & 1) != 0, hi = (tig & 2) != 0;
  auto row_of = [&](u32 r) { return grp.x + min(r, grp.y - 1); };

  for (int t = tid; t < W16_ROWS * H; t += 128) sw[t / H][t % H] = w[(u64)row_of(t / H) * H + t % H];
  // B: column n (row n / H, head n % H), k16 step s: chunk 2s holds k = 0..7 (e = 0, 1 of
  // the four quad threads' words), chunk 2s + 1 holds k = 8..15 (e = 2, 3).
  for (int t = tid; t < W16_N * 4; t += 128) {
    const int n = t / 4, tg = t % 4;
    u32 x[W16_S];
    w16_load(x, q + ((u64)row_of(n / H) * H + n % H) * D, tg);
#pragma unroll
    for (int s = 0; s < W16_S; ++s) {
      *reinterpret_cast<u32 *>(&sB[wg_off(n, 2 * s, W16_N) + 4 * tg]) = e4m3x2_f16x2(x[s]);
      *reinterpret_cast<u32 *>(&sB[wg_off(n, 2 * s + 1, W16_N) + 4 * tg]) = e4m3x2_f16x2(x[s] >> 16);
    }
  }
  fence_proxy_async();
  __syncthreads();

  // This thread's keys in a tile: 16 warp + gid (kk = 0) and + 8 (kk = 1); the next
  // tile's bytes and scales are loaded while this one is computed.
  u32 raw[2][W16_S];
  float ksc[2];
  auto prefetch = [&](u32 c) { w16_keys(raw, ksc, k, k_scale32, ks, grp.z, c, warp, gid, tig); };
  prefetch(blockIdx.x);
  constexpr u32 lbo = (W16_N / 8) * 128;  // chunk to chunk
  for (u32 c = blockIdx.x; c < nchunks; c += gridDim.x) {
    const u32 j0 = c * W16_KEYS;
    u32 a[W16_S][4];
#pragma unroll
    for (int s = 0; s < W16_S; ++s) {
      a[s][0] = e4m3x2_f16x2(raw[0][s]);
      a[s][1] = e4m3x2_f16x2(raw[1][s]);
      a[s][2] = e4m3x2_f16x2(raw[0][s] >> 16);
      a[s][3] = e4m3x2_f16x2(raw[1][s] >> 16);
    }
    const float kscale = odd ? ksc[1] : ksc[0];  // this lane's key after the head sum
    if (c + gridDim.x < nchunks) prefetch(c + gridDim.x);

    float acc[64];
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < W16_S; ++s)
      wgmma_m64n128k16_f16_rs(acc, a[s], wgmma_desc(sB + 2 * s * lbo, lbo, 128), s > 0 ? 1u : 0u);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(acc);

    // acc[4j + 2kk + e]: key 16 warp + gid + 8 kk, column 8 j + 2 tig + e (row j / 8);
    // the head sum over the eight n-tiles of each row, then the key scale.
    float p[2][2];
    tol_lane_heads(&acc[0], sw[0], tig, p[0][0], p[0][1]);
    tol_lane_heads(&acc[32], sw[1], tig, p[1][0], p[1][1]);
    const float hsum = tol_quad_sum(p[0][0], p[0][1], p[1][0], p[1][1], odd, hi);
    store_logit(logits, row_off, row_n, grp, hi ? 1u : 0u, j0 + 16 * warp + gid, odd,
                __fmul_rn(hsum, kscale));
  }
}
// ---- mqa_logits_w8: E4M3 x E4M3 with H = 64 on fp8 wgmma ------------------------------
// mqa_logits_w16's block and tile, with the operands left in E4M3: D / 32
// e4m3 k32 steps per 64-key tile instead of D / 16 f16 k16 ones (half the tensor steps
// and half the shared-memory bytes of B per tile, no cvt of the keys), the keys' bytes
// straight from global memory into the A fragments (the mma.sync m16n8k32 A layout of
// each warp's 16 keys: a0/a1 dims 4 tig .. + 3 of keys gid / gid + 8, a2/a3 the same at
// + 16). Permuted dim order as in w16: thread tig of a quad reads D / 4 contiguous bytes
// of each key (words w = 0 .. D / 16 - 1); word 2 s is k = 4 tig + 0..3 of k32 step s,
// word 2 s + 1 is k = 16 + 4 tig + 0..3; B (the queries, staged once per block) uses the
// same order: word 2 s of column n's thread tg -> bytes 4 tg of chunk 2 s, word 2 s + 1 ->
// bytes 4 tg of chunk 2 s + 1.
//
// Accuracy: fp8 wgmma adds products with about 13 bits kept, aligned to the largest
// exponent-field sum of the step (cuda::FP8_WGMMA_TOLERANCE_LOG2 has what the H200
// showed). W8_SPLIT=1 (the default form) starts a fresh accumulator for every k32 step
// and adds the steps in f32 on the CUDA cores (no step cut to the unit of a running
// sum: the fp8 recipe of promoting partial sums), per row as m64n64k32; W8_SPLIT=0
// chains the D / 32 steps in the tensor core's accumulator. Neither meets SPEC 4's
// 2^-8 M when a subnormal operand is in a step's product of largest exponent fields,
// so this kernel is an A/B knob (W8=1), not the default.
#define W8_S (D / 32)  // k32 steps per tile
#ifndef W8_SPLIT
#define W8_SPLIT 1
#endif
// Blocks per SM the registers must allow: at D = 128 the split form takes 127 registers
// (one k32 job in flight; two took 161 registers, 3 blocks, and lost: v32-16k 5.12
// against 4.87 ms, benches/RESULTS.md v11), the chained form 123.
#ifndef W8_MIN_BLOCKS
#define W8_MIN_BLOCKS 4
#endif

extern "C" __global__ void __launch_bounds__(128, W8_MIN_BLOCKS) mqa_logits_w8(
    const u8 *__restrict__ q, const u8 *__restrict__ q_scale, const u8 *__restrict__ k,
    const u8 *__restrict__ k_scale8, const float *__restrict__ k_scale32,
    const float *__restrict__ w, const u32 *__restrict__ row_n, const u32 *__restrict__ row_ks,
    const u64 *__restrict__ row_off, const uint4 *__restrict__ groups, u32 group0,
    float *__restrict__ logits, u32 *__restrict__ paths) {
  __shared__ __align__(128) u8 sB[W16_N * D];
  __shared__ __align__(8) float sw[W16_ROWS][H];

  const uint4 grp = groups[group0 + blockIdx.y];
  const u32 nchunks = (grp.z + W16_KEYS - 1) / W16_KEYS;
  if (blockIdx.x >= nchunks) return;
  const u32 ks = row_ks[grp.x];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gid = lane >> 2, tig = lane & 3;
  const bool odd = (tig & 1) != 0, hi = (tig & 2) != 0;
  auto row_of = [&](u32 r) { return grp.x + min(r, grp.y - 1); };

  for (int t = tid; t < W16_ROWS * H; t += 128) sw[t / H][t % H] = w[(u64)row_of(t / H) * H + t % H];
  for (int t = tid; t < W16_N * 4; t += 128) {
    const int n = t / 4, tg = t % 4;
    u32 x[W16_S];
    w16_load(x, q + ((u64)row_of(n / H) * H + n % H) * D, tg);
#pragma unroll
    for (int s = 0; s < W8_S; ++s) {
      *reinterpret_cast<u32 *>(&sB[wg_off(n, 2 * s, W16_N) + 4 * tg]) = x[2 * s];
      *reinterpret_cast<u32 *>(&sB[wg_off(n, 2 * s + 1, W16_N) + 4 * tg]) = x[2 * s + 1];
    }
  }
  fence_proxy_async();
  __syncthreads();

  // This thread's keys in a tile: 16 warp + gid (kk = 0) and + 8 (kk = 1); the next
  // tile's bytes and scales are loaded while this one is computed.
  u32 raw[2][W16_S];
  float ksc[2];
  auto prefetch = [&](u32 c) { w16_keys(raw, ksc, k, k_scale32, ks, grp.z, c, warp, gid, tig); };
  prefetch(blockIdx.x);
  constexpr u32 lbo = (W16_N / 8) * 128;  // chunk to chunk
  for (u32 c = blockIdx.x; c < nchunks; c += gridDim.x) {
    const u32 j0 = c * W16_KEYS;
    // A fragment of k32 step s: words 2 s and 2 s + 1 of the thread's two keys.
    u32 a[W8_S][4];
#pragma unroll
    for (int s = 0; s < W8_S; ++s) {
      a[s][0] = raw[0][2 * s];
      a[s][1] = raw[1][2 * s];
      a[s][2] = raw[0][2 * s + 1];
      a[s][3] = raw[1][2 * s + 1];
    }
    const float kscale = odd ? ksc[1] : ksc[0];  // this lane's key after the head sum

#if W8_SPLIT
    // Jobs i = 0 .. 2 W8_S - 1: row r = i / W8_S, k32 step s = i % W8_S (row r's columns
    // start 8 core matrices, 8 * 128 bytes, into each chunk), each an m64n64k32 from a
    // zero accumulator into the temporary t, one at a time; the CUDA cores add each into
    // the row's sums. A row's sums, once whole, go through the lane's part of the head
    // sum (tol_lane_heads) at once, so only one row's 32 sums are live.
    constexpr int jobs = 2 * W8_S;
    float t[32], acc[32], p[2][2];
    auto issue = [&](int i) {
      const int r = i / W8_S, s = i % W8_S;
      wgmma_fence();
      wgmma_m64n64k32_e4m3_rs(t, a[s], wgmma_desc(sB + 2 * s * lbo + r * 8 * 128, lbo, 128));
      wgmma_commit();
    };
    issue(0);
#pragma unroll
    for (int i = 0; i < jobs; ++i) {
      const int r = i / W8_S, s = i % W8_S;
      wgmma_wait<0>();
      fence_regs(t);
#pragma unroll
      for (int e = 0; e < 32; ++e) acc[e] = s == 0 ? t[e] : __fadd_rn(acc[e], t[e]);
      if (i + 1 < jobs) issue(i + 1);
      if (s == W8_S - 1) tol_lane_heads(acc, sw[r], tig, p[r][0], p[r][1]);
    }
    // The next tile's keys, loaded while the rest of the epilogue runs (every MMA of
    // this tile, whose A fragments they replace, has completed).
    if (c + gridDim.x < nchunks) prefetch(c + gridDim.x);
    const float hsum = tol_quad_sum(p[0][0], p[0][1], p[1][0], p[1][1], odd, hi);
#else
    if (c + gridDim.x < nchunks) prefetch(c + gridDim.x);
    float acc[64];
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < W8_S; ++s)
      wgmma_m64n128k32_e4m3_rs(acc, a[s], wgmma_desc(sB + 2 * s * lbo, lbo, 128), s > 0 ? 1u : 0u);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(acc);
    float p[2][2];
    tol_lane_heads(&acc[0], sw[0], tig, p[0][0], p[0][1]);
    tol_lane_heads(&acc[32], sw[1], tig, p[1][0], p[1][1]);
    const float hsum = tol_quad_sum(p[0][0], p[0][1], p[1][0], p[1][1], odd, hi);
#endif
    store_logit(logits, row_off, row_n, grp, hi ? 1u : 0u, j0 + 16 * warp + gid, odd,
                __fmul_rn(hsum, kscale));
  }
}
#endif
