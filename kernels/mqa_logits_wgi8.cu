// mqa_logits_wgi8: SPEC 4's logits of the exact class (E2M1 x E2M1) for H = 32 and
// D >= 64 on s8 wgmma where a tile's scales admit it, else mqa_logits_wgr's tile.
// Compiled after common.cuh, logits_common.cuh and logits_wgr.cuh (the fallback tile,
// its prologue and key prefetch), for those variants only, under the int8_exact hook.
//
// ==== the int8 path, and when it is bitwise ====
//
// One (row, head) query vector against one key, group bytes eq_g and ek_g (g < G),
// Q_d = 2 q_d and K_d = 2 k_d (integers in [-12, 12]), X_g = 4 s_g = sum_(d in g) Q_d K_d
// (|X_g| <= 32 * 144 = 4608 < 2^13), e_g = eq_g + ek_g. Each vector shifts its values
// by its group's offset from the vector's smallest byte: sq_g = eq_g - eq_min,
// sk_g = ek_g - ek_min, operands Q_d 2^sq_g and K_d 2^sk_g.
// - s8: with spans sq_g, sk_g <= 3 every operand is at most 12 * 8 = 96 in magnitude.
// - One s8.s8.s32 chain over all D dims (G k32 steps, one accumulator) gives
//   Y = sum_g X_g 2^(sq_g + sk_g) exactly: |Y| <= G * 4608 * 2^6 <= 1,179,648 < 2^21, so
//   no i32 overflow, and f32(Y) (one I2F) is exact.
// - SPEC 4's exact terms: s_g 2^(eq_g - 127) 2^(ek_g - 127) = X_g 2^(e_g - 256) =
//   X_g 2^(sq_g + sk_g) 2^E with E = eq_min + ek_min - 256 (the -256 is -127 - 127 and
//   the 1/4 of 4 s_g = X_g), so their exact sum is Y 2^E.
// - The path computes C = 2^(eq_min - 129) * 2^(ek_min - 127) (each factor an f32 for
//   every byte 0..254: 2^-129 and 2^-127 are subnormals) and a_h = f32(Y) * C. C's exact
//   value is 2^E, an f32 when -149 <= E <= 127: then C is exact and a_h is Y 2^E rounded
//   once.
// SPEC 4's steps are all exact when the guard below holds:
// - u_g = f32(s_g) * 2^(eq_g - 127) = X_g 2^(eq_g - 129): a multiple of 2^-129 with at
//   most 13 significant bits, below 4608 * 2^(eq_g - 129) < 2^128 for eq_g <= 244.
// - t_g = u_g * 2^(ek_g - 127) = X_g 2^(e_g - 256): a multiple of 2^E (e_g >= eq_min +
//   ek_min) with |t_g| / 2^E < 2^13 * 2^6; an f32 when E >= -149 and
//   4608 * 2^(e_g - 256) < 2^128 (e_g <= 371).
// - every partial sum of SPEC 4's pairwise sum, a_h included, is N 2^E with
//   |N| <= G * 4608 * 2^6 < 2^21 and magnitude at most G * 4608 * 2^(max e_g - 256):
//   an f32 for E >= -149 and max e_g <= 369 (G = 4: 18432 * 2^113 < 2^128) or 370
//   (G = 2: 9216 * 2^114 < 2^128).
// So SPEC 4's a_h is exactly Y 2^E, and so is the path's (its one rounding is of a value
// that is an f32). Zeros: an exact 0 is +0 on both (SPEC 4's sums of +0 and x + (-x) in
// round to nearest are +0; f32(0) * C = +0), and relu maps either zero to +0 anyway.
// No infinity or NaN arises inside the guard on either side.
//
// The guard, evaluated per tile from each side's window (a block-level condition, warp-
// and block-uniform: the wgmma needs the whole warpgroup on one path):
//   queries (once per block, the 64 (row, head) vectors): every vector spans <= 3, and
//   q_hi <= 244 (q_lo, q_hi: the smallest and largest byte of the block);
//   keys (per tile, each key of the tile in the group): its bytes span <= 3,
//   ek_min + q_lo >= 107 and ek_max + q_hi <= 369 (G = 4) or 370 (G = 2).
// It implies every condition above for every (vector, key) pair of the tile:
// eq_min + ek_min >= q_lo + ek_min >= 107 (E >= -149, and E <= 369 - 256 < 127),
// eq_g <= q_hi <= 244, e_g <= q_hi + ek_max. It is docs/numerics.md's block guard (there
// derived with the cases that make each bound necessary). A tile it rejects runs
// mqa_logits_wgr's arithmetic on the same B staging that kernel uses (sB, folded when
// the queries fold), so both paths are bitwise SPEC 4 and a tile's path changes no bit.
//
// ==== layout ====
//
// As mqa_logits_wgr (the dims' permutation, A from registers, B in shared memory): the s8
// A fragment of m64nNk32 and the s32 accumulator have the e4m3 ones' layouts, so sB8
// (the shifted s8 queries) is staged at sB's offsets and the accumulator element i of a
// thread is key 16 warp + gid + 8 ((i >> 1) & 1), column 8 (i >> 2) + 2 tig + (i & 1)
// (column n: row n / 32, head n % 32), which two_row_head_sum takes as it is.

// Blocks per SM the registers must allow: 4 at D = 64; at D = 128, 3 (156 registers, no
// spill), since the fallback tile beside the int8 one does not fit 128 registers (4
// blocks spill 168 bytes, inside the int8 loop too). The int8 tile alone takes 91.
#ifndef WGI8_MIN_BLOCKS
#define WGI8_MIN_BLOCKS (G == 4 ? 3 : 4)
#endif

// ==== the guard's bounds (docs/numerics.md section 6) ====

// Largest span of a vector's group bytes: 12 * 2^3 = 96 fits s8, 12 * 2^4 does not.
#define I8_MAX_SPAN 3
// Smallest q_lo + ek_min: C = 2^(eq_min + ek_min - 256) >= 2^-149.
#define I8_MIN_EXP_SUM 107
// Largest query byte: SPEC 4's first product below 2^128.
#define I8_MAX_Q_EXP 244
// Largest q_hi + ek_max: G * 4608 * 2^(x - 256) < 2^128.
#define I8_MAX_EXP_SUM (G == 4 ? 369 : 370)
static_assert(G == 2 || G == 4, "mqa_logits_wgi8: D = 64 or 128");

// Packed window of query vectors for one min-reduction (__vminu4): byte 0 the smallest
// byte, byte 1 255 - the largest, byte 2 1 while every vector spans <= I8_MAX_SPAN. A
// thread without a vector holds the neutral 0x0001FFFF.
#define I8_QWIN_NONE 0x0001FFFFu

// ==== one key tile, int8 ====

// One key tile on the int8 path from this thread's keys (raw, rsc): the s8 A fragments (each
// key's values shifted by its group's offset from kmin[kk], its smallest byte), then
// next() (the next tile's prefetch), one s32 chain of G k32 steps against sB8, and
// a_h = f32(Y) * (cq * ck) per (column, key), cq = sqc[column] = 2^(eq_min - 129),
// ck = 2^(ek_min - 127) of key kk. Returns the logit of this thread's row and key, as
// wgr_tile does.
template <class Next>
__device__ __forceinline__ float wgi8_tile(const u32 (&raw)[2][G], const u32 (&rsc)[2],
                                           const int (&kmin)[2],
                                           const u8 *sB8, const float *sqc,
                                           const float (*sw)[H], const int tig,
                                           const bool odd, const bool hi, Next next) {
  constexpr u32 lbo = (WGR_N / 8) * 128;
  const float ck[2] = {ue8m0_pow2((u32)kmin[0], 0), ue8m0_pow2((u32)kmin[1], 0)};
  u32 af[G][4];
#pragma unroll
  for (int kk = 0; kk < 2; ++kk)
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const int sk = (int)((rsc[kk] >> (8 * g)) & 0xFFu) - kmin[kk];
      e2m1_word_s8(raw[kk][g], sk, af[g][kk], af[g][2 + kk]);
    }
  fence_regs_a(af);
  next();
  int y[32];
  wgmma_fence();
#pragma unroll
  for (int g = 0; g < G; ++g)
    wgmma_m64n64k32_s8_rs(y, af[g], wgmma_desc(sB8 + 2 * g * lbo, lbo, 128), g > 0 ? 1u : 0u);
  wgmma_commit();
  wgmma_wait<0>();
  fence_regs_s32(y);
  float a[32];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float2 cq = *reinterpret_cast<const float2 *>(&sqc[8 * j + 2 * tig]);
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      const int i = 4 * j + 2 * kk;
      a[i] = __fmul_rn(__int2float_rn(y[i]), __fmul_rn(cq.x, ck[kk]));
      a[i + 1] = __fmul_rn(__int2float_rn(y[i + 1]), __fmul_rn(cq.y, ck[kk]));
    }
  }
  return two_row_head_sum<4>(a, sw, tig, odd, hi);
}

// Counts a block's tiles on each path (thread 0; every thread calls it).
__device__ __forceinline__ void count_int8_tiles(u32 *paths, const u32 n_i8, const u32 n_fb) {
  if (paths == nullptr || threadIdx.x != 0) return;
  if (n_i8) atomicAdd(&paths[LG_PATH_I8], n_i8);
  if (n_fb) atomicAdd(&paths[LG_PATH_I8_FALLBACK], n_fb);
}

// ==== kernel ====

// block: rows grp.x + [0, 2) x 32 heads x keys 64 c + [0, 64) -> logits[row, key]
// (grp = groups[group0 + blockIdx.y], one warpgroup; c = blockIdx.x, + gridDim.x, ...)
extern "C" __global__ void __launch_bounds__(WGR_THREADS, WGI8_MIN_BLOCKS) mqa_logits_wgi8(
    const u8 *__restrict__ q, const u8 *__restrict__ q_scale, const u8 *__restrict__ k,
    const u8 *__restrict__ k_scale8, const float *__restrict__ k_scale32,
    const float *__restrict__ w, const u32 *__restrict__ row_n, const u32 *__restrict__ row_ks,
    const u64 *__restrict__ row_off, const uint4 *__restrict__ groups, u32 group0,
    float *__restrict__ logits, u32 *__restrict__ paths LG_PAGED_PARAMS) {
  __shared__ __align__(128) u8 sB[WGR_N * D];
  __shared__ __align__(128) u8 sB8[WGR_N * D];
  __shared__ __align__(8) float sqs[WGR_ROWS][G * H];
  __shared__ __align__(8) float sw[WGR_ROWS][H];
  __shared__ __align__(8) float sqc[WGR_N];
  __shared__ u32 stab[15][2];
  __shared__ u32 swq[2][WGR_THREADS / 32];
  __shared__ u32 sqwin[WGR_THREADS / 32];

  const uint4 grp = groups[group0 + blockIdx.y];
  const u32 nchunks = (grp.z + WGR_KEYS - 1) / WGR_KEYS;
  if (blockIdx.x >= nchunks) return;
  const u32 ks = row_ks[grp.x];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gid = lane >> 2, tig = lane & 3;
  const bool odd = (tig & 1) != 0, hi = (tig & 2) != 0;
  auto row_of = [&](u32 r) { return grp.x + min(r, grp.y - 1); };

  int qbase[G];
  const bool fold_q =
      wgr_prologue(q_scale, w, row_of, sw, sqs, stab, swq[0], swq[1], qbase, tid, lane, warp);
  bool qsafe = fold_q;
#pragma unroll
  for (int g = 0; g < G; ++g) qsafe = qsafe && qbase[g] >= 107 && qbase[g] <= 129;

  // The int8 query window: thread n < 64 takes column n's vector (its bytes' span, its
  // cq = 2^(eq_min - 129)), reduced over the block with the staging's barrier.
  u32 qwin = I8_QWIN_NONE;
  if (tid < WGR_N) {
    const u64 qrow = (u64)row_of(tid / H) * H + tid % H;
    u32 mn = 255u, mx = 0u;
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const u32 e = q_scale[qrow * G + g];
      mn = min(mn, e);
      mx = max(mx, e);
    }
    sqc[tid] = ue8m0_pow2(mn, 2);
    qwin = mn | ((255u - mx) << 8) | ((mx - mn <= I8_MAX_SPAN ? 1u : 0u) << 16);
  }
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) qwin = __vminu4(qwin, __shfl_xor_sync(FULL_MASK, qwin, o));
  if (lane == 0) sqwin[warp] = qwin;

  wgr_stage_queries(q, q_scale, row_of, fold_q, qbase, stab, sB, tid);
  // sB8: the same words as s8 values shifted by sq_g = eq_g - eq_min (clamped to 3 in a
  // vector that spans more: the block then never takes the int8 path).
  for (int t = tid; t < WGR_N * G * 4; t += WGR_THREADS) {
    const int n = t / (G * 4), g = (t / 4) % G, tt = t % 4;
    const u64 qrow = (u64)row_of(n / H) * H + n % H;
    int mn = 255;
#pragma unroll
    for (int gg = 0; gg < G; ++gg) mn = min(mn, (int)q_scale[qrow * G + gg]);
    const int sq = min((int)q_scale[qrow * G + g] - mn, I8_MAX_SPAN);
    const u32 word = *reinterpret_cast<const u32 *>(q + qrow * (D / 2) + 16 * g + 4 * tt);
    u32 lo, hb;
    e2m1_word_s8(word, sq, lo, hb);
    *reinterpret_cast<u32 *>(&sB8[wg_off(n, 2 * g, WGR_N) + 4 * tt]) = lo;
    *reinterpret_cast<u32 *>(&sB8[wg_off(n, 2 * g + 1, WGR_N) + 4 * tt]) = hb;
  }
  fence_proxy_async();
  __syncthreads();
  u32 bwin = sqwin[0];
#pragma unroll
  for (int i = 1; i < WGR_THREADS / 32; ++i) bwin = __vminu4(bwin, sqwin[i]);
  const int q_lo = (int)(bwin & 0xFFu), q_hi = 255 - (int)((bwin >> 8) & 0xFFu);
  const bool q_i8 = ((bwin >> 16) & 0xFFu) != 0u && q_hi <= I8_MAX_Q_EXP;
  // The key side of the guard as bounds on a key's smallest and largest byte.
  const int k_floor = I8_MIN_EXP_SUM - q_lo, k_cap = I8_MAX_EXP_SUM - q_hi;

  u32 raw[2][G], rsc[2];
  bool none[2];
  const bool sc_word = (G == 4 || G == 2) &&
                       (reinterpret_cast<size_t>(k_scale8) & (size_t)(G - 1)) == 0;
  wgr_prefetch(raw, rsc, none, k, k_scale8, ks, grp.z, blockIdx.x, sc_word, warp, gid, tig PG_PASS);
  bool two_mul = false;  // some fallback tile ran the two multiplies
  u32 n_i8 = 0u;         // tiles on the int8 path (the block's others fell back)
  // Two loops: a block whose queries the guard rejects runs mqa_logits_wgr's, with no
  // per-tile decision and none of the int8 path's registers live.
  if (q_i8) {
    for (u32 c = blockIdx.x; c < nchunks; c += gridDim.x) {
      const u32 j0 = c * WGR_KEYS;
      // The key side of the guard for this thread's keys (a key past the group's is never
      // stored: it admits), then over the block (the same answer in every thread).
      int kmin[2];
      bool ok = true;
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {
        int mn = 255, mx = 0;
#pragma unroll
        for (int g = 0; g < G; ++g) {
          const int e = (int)((rsc[kk] >> (8 * g)) & 0xFFu);
          mn = min(mn, e);
          mx = max(mx, e);
        }
        kmin[kk] = mn;
        ok = ok && (none[kk] || (mx - mn <= I8_MAX_SPAN && mn >= k_floor && mx <= k_cap));
      }
      const bool i8 = __syncthreads_and(ok ? 1 : 0) != 0;
      auto next = [&] {
        if (c + gridDim.x < nchunks)
          wgr_prefetch(raw, rsc, none, k, k_scale8, ks, grp.z, c + gridDim.x, sc_word, warp, gid, tig PG_PASS);
      };
      float logit;
      if (i8) {
        logit = wgi8_tile(raw, rsc, kmin, sB8, sqc, sw, tig, odd, hi, next);
        ++n_i8;
      } else {
        logit = wgr_tile<true>(raw, rsc, sB, fold_q, qsafe, sqs, sw, stab, two_mul, tig, odd, hi, next);
      }
      store_logit(logits, row_off, row_n, grp, hi ? 1u : 0u, j0 + 16 * warp + gid, odd, logit);
    }
  } else {
    for (u32 c = blockIdx.x; c < nchunks; c += gridDim.x) {
      const u32 j0 = c * WGR_KEYS;
      const float logit =
          wgr_tile<true>(raw, rsc, sB, fold_q, qsafe, sqs, sw, stab, two_mul, tig, odd, hi, [&] {
            if (c + gridDim.x < nchunks)
              wgr_prefetch(raw, rsc, none, k, k_scale8, ks, grp.z, c + gridDim.x, sc_word, warp, gid, tig PG_PASS);
          });
      store_logit(logits, row_off, row_n, grp, hi ? 1u : 0u, j0 + 16 * warp + gid, odd, logit);
    }
  }
  count_fold_paths(paths, fold_q, two_mul);
  count_int8_tiles(paths, n_i8, (nchunks - 1 - blockIdx.x) / gridDim.x + 1 - n_i8);
}
