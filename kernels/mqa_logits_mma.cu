// mqa_logits: SPEC 4's logits on mma.sync, for every variant (the fallback where a
// wgmma kernel serves the variant, and WGMMA=0). Compiled after common.cuh and
// logits_common.cuh.
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
// Tolerance class: e4m3 MMA with f32 accumulate (E2M1 operands converted exactly to
// E4M3). E4M3 x E4M3 chains the groups in the accumulator (every c_g is 1); a mixed
// pair takes each group's f32 MMA sum, scales it in f64 and sums the groups pairwise
// in f64, rounding once, as SPEC 4 does.

// ==== configuration ====

// Rows per block, one warp each: at H >= 32 the kernel is register-bound, and two or
// three 4-warp blocks per SM beat one of 8 warps. The host computes the same
// (kernels::logits_rows) and reads an override of it from $DSA_CUDA_DEFINES too.
#ifndef LG_ROWS
#define LG_ROWS (H >= 32 ? 4 : 8)
#endif
// Keys per tile: two pairs of 16-key m-tiles (kernels::LOGITS_KEYS).
#define LG_KEYS 64
// Threads per block: one warp per row.
#define LG_THREADS (LG_ROWS * 32)
// Blocks per SM the register allocation must allow: per shape, the most that fit
// without spilling (2 blocks of 8 warps would cap registers at 128 and spill).
#ifndef LG_MIN_BLOCKS
#define LG_MIN_BLOCKS (H == 64 ? (QF == 0 && KF == 0 ? 3 : 2) : (H == 32 && EXACT ? 2 : 1))
#endif
// The exact class runs f16 MMAs (m16n8k16, two per group): native on sm_90, where the
// e4m3 mma.sync is emulated by per-use F2FP unpacks to f16; doubled E2M1 values (and
// with folding, times 2^s) are exact f16.
#define KW (EXACT ? 2 : 1)     // k16 steps per 32-dim group in the fragments
#define EB (EXACT ? 2 : 1)     // bytes per staged key element
#define KSTRIDE (EB * D + 16)  // bytes per staged key row (+16: ldmatrix rows in distinct banks)
static_assert(LG_KEYS % 32 == 0, "keys per block: whole pairs of 16-key m-tiles");
static_assert((KSTRIDE / 4) % 8 == 4, "key row stride must rotate banks by 4 words");

// ==== one key tile ====

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
          ldmatrix_x4(a[mt][g][kw],
                      skey + r * KSTRIDE + EB * (g * 32 + kw * 16) + (lane >> 4) * 16);
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

// ==== key-tile folding ====

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

// ==== kernel ====

// block: rows grp.x + [0, LG_ROWS) x H heads x keys 64 c + [0, 64) -> logits[row, key]
// (grp = groups[group0 + blockIdx.y], one warp per row; c = blockIdx.x, + gridDim.x, ...)
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
    u32 *__restrict__ paths  // exact-class folding counters (LG_PATH_*), or null
    LG_PAGED_PARAMS) {
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
      sqs[warp][g * H + h] = ue8m0_pow2(q_scale[(u64)row * H * G + t], 0);
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
#if DSA_PAGED
        pre[i] = *reinterpret_cast<const uint4 *>(
            paged_key(k, page_table, ks, j0 + kk, page_log2).code + p * 16);
#else
        pre[i] = *reinterpret_cast<const uint4 *>(k + (u64)(ks + j0 + kk) * (KV * 16) + p * 16);
#endif
    }
#pragma unroll
    for (int i = 0; i < PRE_S; ++i) {
      const int t = tid + i * LG_THREADS;
#if DSA_PAGED
#define MMA_KSC8(t) paged_key(k, page_table, ks, j0 + (t) / G, page_log2).scale[(t) % G]
#else
#define MMA_KSC8(t) k_scale8[(u64)(ks + j0) * G + (t)]
#endif
#if EXACT
      pre_s[i] = 256u;  // "none" for the window: a key past the group's
      if (t < NS && (u32)(t / G) < nk) pre_s[i] = MMA_KSC8(t);
#else
      pre_s[i] = 0.0f;
      if (t < NS && (u32)(t / G) < nk) pre_s[i] = ue8m0_pow2(MMA_KSC8(t), 0);
#endif
#undef MMA_KSC8
    }
  };
  // E4M3: global -> shared buffer `buf` directly, zero-filled past the group's keys.
  auto issue = [&](u32 c, int buf) {
    const u32 j0 = c * LG_KEYS;
    const u32 nk = min((u32)LG_KEYS, grp.z - j0);
    for (int t = tid; t < LG_KEYS * KV; t += LG_THREADS) {
      const int kk = t / KV, p = t % KV;
      const bool ok = (u32)kk < nk;
#if DSA_PAGED
      cp_async16(&skey[buf][kk * KSTRIDE + p * 16],
                 paged_key(k, page_table, ks, j0 + (ok ? kk : 0), page_log2).code + p * 16,
                 ok ? 16u : 0u);
#else
      cp_async16(&skey[buf][kk * KSTRIDE + p * 16],
                 k + (u64)(ks + j0 + (ok ? kk : 0)) * (KV * 16) + p * 16, ok ? 16u : 0u);
#endif
    }
    for (int t = tid; t < LG_KEYS; t += LG_THREADS) {
      const bool ok = (u32)t < nk;
#if DSA_PAGED
      cp_async4(&skscale[buf][t],
                reinterpret_cast<const float *>(
                    paged_key(k, page_table, ks, j0 + (ok ? t : 0), page_log2).scale),
                ok ? 4u : 0u);
#else
      cp_async4(&skscale[buf][t], k_scale32 + ks + j0 + (ok ? t : 0), ok ? 4u : 0u);
#endif
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
