// mqa_logits: SPEC 4 on tensor cores.
// block: one row group (<= LG_ROWS rows of one request, one warp each) x key tiles
//        c = blockIdx.x, blockIdx.x + gridDim.x, .. of LG_KEYS keys -> logits[row_off[i] + j], j < n_i.
//
// Variant macros (set by the host): DSA_H (heads), DSA_G (groups of 32 dims),
// DSA_QF, DSA_KF (0 = E4M3, 1 = E2M1).
//
// Layout: keys are the MMA's M side (16 keys per m-tile, staged through shared memory
// and fed by ldmatrix), heads its N side (8 per n-tile, the query row's fragments live
// in registers), one k=32 step per scale group. A lane of the m16n8 accumulator holds
// keys (gid, gid+8) x heads (2*tig, 2*tig+1), so SPEC 4's head sum P is: one add in the
// thread, a shuffle at lane offset 1, one at offset 2 (tig bits = head bits 1, 2), then
// the n-tiles pairwise in the thread.
//
// Exact class (E2M1 x E2M1): the MMA runs on doubled values (integers in [-12, 12],
// exact in E4M3) with f32 accumulation: every product is an integer <= 144 and every
// partial sum an integer below 4608 < 2^13, so 4*s_g comes out exact in f32 in any
// summation order, even from an accumulator that keeps only 13 bits (and the tests
// check it bitwise). t_g = (s_g * 2^(eq-127)) * 2^(ek-127) is computed as
// (4 s_g * 2^(eq-129)) * 2^(ek-127): the same real products, one rounding each, so
// bitwise the reference. (An s8 MMA gives the same 4*s_g but
// needs an int->f32 conversion per group: two more epilogue ops.)
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
// Rows per block: 4 for H = 64 (register-bound: smaller blocks fit 3 per SM), else 8.
// The host computes the same (kernels::logits_rows) and reads overrides of it from
// $DSA_CUDA_DEFINES too.
#ifndef LG_ROWS
#define LG_ROWS (H == 64 ? 4 : 8)
#endif
#define LG_KEYS 64
#define LG_THREADS (LG_ROWS * 32)
// Blocks per SM the register allocation must allow (a tuning knob: 2 caps registers
// at 128 and spills; see benches/RESULTS.md).
#ifndef LG_MIN_BLOCKS
#define LG_MIN_BLOCKS (H == 64 ? (QF == 0 && KF == 0 ? 3 : 2) : 1)
#endif
#define KSTRIDE (D + 16)  // bytes per staged key row: ldmatrix rows land in distinct banks

static_assert(H == 8 || H == 16 || H == 32 || H == 64, "H must be a power of two in 8..=64");
static_assert(G == 1 || G == 2 || G == 4, "D must be 32, 64 or 128");
static_assert(LG_KEYS % 32 == 0, "keys per block: whole pairs of 16-key m-tiles");
static_assert((KSTRIDE / 4) % 8 == 4, "key row stride must rotate banks by 4 words");

// relu as SPEC 4 writes it (a compare and a select), or (RELU_FMAX=1, an experiment)
// as one max.f32, which returns +0 for NaN; its sign of max(-0, +0) is what the bitwise
// tests check.
#if defined(RELU_FMAX) && RELU_FMAX
#define RELU(x) fmaxf((x), 0.0f)
#else
#define RELU(x) relu_f32(x)
#endif

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

// One key tile (keys j0 .. j0+LG_KEYS-1, staged in shared memory) for one warp's row:
// MMAs, SPEC 4's epilogue, and the row's logits out[j] for j < n.
__device__ __forceinline__ void compute_tile(const u32 j0, const u32 n, float *__restrict__ out,
                                             const u8 *skey, const float *skscale,
                                             const float *sqs, const float *sw,
                                             const u32 (&bq)[NT][G][2], const int lane,
                                             const int gid, const int tig, const bool odd,
                                             const bool hi) {

#pragma unroll 1
  for (int mp = 0; mp < LG_KEYS / 32; ++mp) {
    const u32 jb = j0 + mp * 32;  // keys jb .. jb+31: m-tiles 2*mp, 2*mp+1
    if (jb >= n) break;
    u32 a[2][G][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const int r = mp * 32 + mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
        ldmatrix_x4(a[mt][g], skey + r * KSTRIDE + g * 32 + (lane >> 4) * 16);
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
          mma_e4m3_zero(acc, a[mt][g], bq[nt][g][0], bq[nt][g][1]);
          const float2 qs = *reinterpret_cast<const float2 *>(&sqs[g * H + nt * 8 + 2 * tig]);
          t[0][g] = __fmul_rn(__fmul_rn(acc[0], qs.x), kc[mt][g][0]);
          t[1][g] = __fmul_rn(__fmul_rn(acc[1], qs.y), kc[mt][g][0]);
          t[2][g] = __fmul_rn(__fmul_rn(acc[2], qs.x), kc[mt][g][1]);
          t[3][g] = __fmul_rn(__fmul_rn(acc[3], qs.y), kc[mt][g][1]);
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) ah[e] = pairwise_f32<G>(t[e]);
#elif QF == 0 && KF == 0
        float acc[4];
        mma_e4m3_zero(acc, a[mt][0], bq[nt][0][0], bq[nt][0][1]);
#pragma unroll
        for (int g = 1; g < G; ++g) mma_e4m3(acc, a[mt][g], bq[nt][g][0], bq[nt][g][1]);
#pragma unroll
        for (int e = 0; e < 4; ++e) ah[e] = acc[e];
#else
        double t[4][G];
#pragma unroll
        for (int g = 0; g < G; ++g) {
          float acc[4];
          mma_e4m3_zero(acc, a[mt][g], bq[nt][g][0], bq[nt][g][1]);
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
        // term_h = w_h * relu(a_h); first head pair in the thread.
        const float u0 = __fadd_rn(__fmul_rn(wv.x, RELU(ah[0])), __fmul_rn(wv.y, RELU(ah[1])));
        const float u1 = __fadd_rn(__fmul_rn(wv.x, RELU(ah[2])), __fmul_rn(wv.y, RELU(ah[3])));
        // Head bit 1 (lane offset 1): even lanes keep key gid, odd lanes key gid+8.
        const float r1 = __shfl_xor_sync(FULL_MASK, odd ? u0 : u1, 1);
        v[mt] = __fadd_rn(odd ? u1 : u0, r1);
      }
      // Head bit 2 (lane offset 2): lanes with tig bit 1 clear keep m-tile 0.
      const float r2 = __shfl_xor_sync(FULL_MASK, hi ? v[0] : v[1], 2);
      s[nt] = __fadd_rn(hi ? v[1] : v[0], r2);
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
    u32 group0, float *__restrict__ logits) {
  // E4M3 keys arrive by cp.async into two buffers (the next tile lands while this one
  // is computed); E2M1 keys are prefetched into registers and decoded into buffer 0.
  constexpr int NBUF = (KF == 1) ? 1 : 2;
  __shared__ __align__(16) u8 skey[NBUF][LG_KEYS * KSTRIDE];
  // Key scales: E2M1 keys 2^(e-127) per (key, group); E4M3 keys the per-key scale.
  __shared__ __align__(16) float skscale[NBUF][LG_KEYS * (KF == 1 ? G : 1)];
  // Per warp (row): query group scales [G][H] and weights [H].
  __shared__ __align__(8) float sqs[LG_ROWS][(QF == 1 ? G : 1) * H];
  __shared__ __align__(8) float sw[LG_ROWS][H];

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
  if (QF == 1) {
    for (int t = lane; t < H * G; t += 32) {
      const int h = t / G, g = t % G;
      // Exact class folds the 1/4 of 4*s_g into the query scale (a power of two: exact).
      sqs[warp][g * H + h] = ue8m0_pow2(q_scale[(u64)row * H * G + t], EXACT ? 2 : 0);
    }
  }
  u32 bq[NT][G][2];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int h = nt * 8 + gid;
#pragma unroll
    for (int g = 0; g < G; ++g) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int d = g * 32 + half * 16 + tig * 4;
        u32 v;
        if (QF == 1) {
          const u16 two = *reinterpret_cast<const u16 *>(q + ((u64)row * H + h) * (D / 2) + d / 2);
          u32 unused;
          e2m1_word<EXACT>(two, v, unused);
        } else {
          v = *reinterpret_cast<const u32 *>(q + ((u64)row * H + h) * D + d);
        }
        bq[nt][g][half] = v;
      }
    }
  }

  // ---- key tiles: this block's chunks blockIdx.x, + gridDim.x, ...; the next tile's
  // global loads are in flight while the current one is computed ----
  constexpr int KV = (KF == 1) ? G : 2 * G;  // 16-byte pieces per key
  constexpr int PRE = (KF == 1) ? (LG_KEYS * KV + LG_THREADS - 1) / LG_THREADS : 1;
  constexpr int NS = LG_KEYS * ((KF == 1) ? G : 1);  // key-side scales per tile
  constexpr int PRE_S = (KF == 1) ? (NS + LG_THREADS - 1) / LG_THREADS : 1;
  uint4 pre[PRE];
  float pre_s[PRE_S];
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
      pre_s[i] = 0.0f;
      if (t < NS && (u32)(t / G) < nk) pre_s[i] = ue8m0_pow2(k_scale8[(u64)(ks + j0) * G + t], 0);
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
  for (u32 c = blockIdx.x; c < nchunks; c += gridDim.x) {
    const u32 j0 = c * LG_KEYS;
    const bool more = c + gridDim.x < nchunks;
    if (KF == 1) {
      // Stage: E2M1 decoded once per block (doubled s8 or E4M3 bytes).
#pragma unroll
      for (int i = 0; i < PRE; ++i) {
        const int t = tid + i * LG_THREADS;
        if (t < LG_KEYS * KV) {
          const int kk = t / KV, p = t % KV;
          uint4 a, b;
          e2m1_word<EXACT>(pre[i].x, a.x, a.y);
          e2m1_word<EXACT>(pre[i].y, a.z, a.w);
          e2m1_word<EXACT>(pre[i].z, b.x, b.y);
          e2m1_word<EXACT>(pre[i].w, b.z, b.w);
          *reinterpret_cast<uint4 *>(&skey[0][kk * KSTRIDE + p * 32]) = a;
          *reinterpret_cast<uint4 *>(&skey[0][kk * KSTRIDE + p * 32 + 16]) = b;
        }
      }
#pragma unroll
      for (int i = 0; i < PRE_S; ++i) {
        const int t = tid + i * LG_THREADS;
        if (t < NS) skscale[0][t] = pre_s[i];
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
    if (active && j0 < n)
      compute_tile(j0, n, logits + row_off[row], skey[buf], skscale[buf], sqs[warp], sw[warp],
                   bq, lane, gid, tig, odd, hi);
    __syncthreads();
    if (KF == 0) buf ^= 1;
  }
}
