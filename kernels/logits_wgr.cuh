// logits_wgr.cuh: the tile of mqa_logits_wgr (mqa_logits_wgr.cu says how it computes)
// and the fallback tile of mqa_logits_wgi8: configuration, the block's query prologue
// and staging, the key prefetch, and one key tile's fp8 group sums. Compiled after
// common.cuh and logits_common.cuh, before either kernel's file.

// ==== configuration ====

static_assert(EXACT && H == 32 && G >= 2, "mqa_logits_wgr: the exact class, H = 32, D >= 64");
// Rows per block: 2 rows x 32 heads fill the 64 columns of one MMA
// (kernels::LOGITS_WGR_ROWS).
#define WGR_ROWS 2
// MMA columns: row r, head h at column 32 r + h.
#define WGR_N (WGR_ROWS * H)
// Keys per tile: the MMA's 64 rows, 16 per warp (kernels::LOGITS_KEYS).
#define WGR_KEYS 64
// Threads per block: one warpgroup, the unit of a wgmma (kernels::LOGITS_WG_THREADS).
#define WGR_THREADS 128
// Blocks per SM the registers must allow: 4 (128 registers, 16 warps per SM) ran
// faster than 3 or 5.
#ifndef WGR_MIN_BLOCKS
#define WGR_MIN_BLOCKS 4
#endif
static_assert(WGR_N == 64, "one m64n64 tile per group");

// ==== prologue: the block's query rows ====

// The start of mqa_logits_wgr: the block's rows' weights into sw, the folding tables
// into stab, the block's query-scale window (whether its queries fold, the exponents
// qbase_g their operands are scaled against) and the query scales sqs (2^(ebq_g - 129)
// when folding, else 2^(eq - 129)), for ROWS rows (mqa_logits_wgi8's blocks hold more).
// One barrier, after which sw, stab and the window are visible.
template <int ROWS = WGR_ROWS, class RowOf>
__device__ __forceinline__ bool wgr_prologue(const u8 *q_scale, const float *w, RowOf row_of,
                                             float (*sw)[H], float (*sqs)[G * H],
                                             u32 (*stab)[2], u32 *swq_max, u32 *swq_min,
                                             int (&qbase)[G], const int tid, const int lane,
                                             const int warp) {
  // Each loop unrolled over its fixed trip count, so that a thread's loads are all in
  // flight at once: a block pays this prologue once per walk over its key tiles.
  constexpr int NW = (ROWS * H + WGR_THREADS - 1) / WGR_THREADS;
  constexpr int NS = (ROWS * H * G + WGR_THREADS - 1) / WGR_THREADS;
#pragma unroll
  for (int i = 0; i < NW; ++i) {
    const int t = tid + i * WGR_THREADS;
    if (t < ROWS * H) sw[t / H][t % H] = w[(u64)row_of(t / H) * H + t % H];
  }
  shift_tables<false>(stab, tid);
  {
    u32 mx = 0u, mn = 255u;
#pragma unroll
    for (int i = 0; i < NS; ++i) {
      const int t = tid + i * WGR_THREADS;
      if (t < ROWS * H * G) {
        const u32 e = q_scale[(u64)row_of(t / (H * G)) * H * G + t % (H * G)];
        mx = max(mx, e);
        mn = min(mn, e);
      }
    }
    warp_window(mx, mn, swq_max, swq_min, lane, warp);
  }
  __syncthreads();
  // The queries fold when each group spans at most 15 binades and no scale byte is above
  // 244 (the reference's first multiply is then exact).
  int qtop[G];
  bool fold_q = block_window<WGR_THREADS / 32>(swq_max, swq_min, qbase, qtop) && SCALE_FOLD;
#pragma unroll
  for (int g = 0; g < G; ++g) fold_q = fold_q && qtop[g] <= 244;
#pragma unroll
  for (int i = 0; i < NS; ++i) {
    const int t = tid + i * WGR_THREADS;
    if (t < ROWS * H * G) {
      const int r = t / (H * G), h = (t % (H * G)) / G, g = t % G;
      sqs[r][g * H + h] = fold_q ? pow2i(qbase[g] - 129)
                                 : ue8m0_pow2(q_scale[(u64)row_of(r) * H * G + h * G + g], 2);
    }
  }
  return fold_q;
}

// ==== one key tile ====

// The tile's t_g and SPEC 4's pairwise group sum from A fragments af[g] in registers
// (X_g of key 16 warp + gid + 8 kk and column 8j + 2 tig + e into a[i], i = 4j + 2 kk +
// e). `one` (per thread: the MMAs are outside the branch, so warps and lanes may
// differ): t_g = X_g * cf[kk][g], one multiply by a power of two; else
// t_g = (X_g * qs) * kc, qs per row and head from shared memory and kc from esc[kk], the
// packed scale bytes of this thread's keys (0 for keys past the group's, whose
// products are 0). LBO: the stride of sB's 16-byte dim chunks (wg_off of a staging of
// LBO / 16 columns, of which the MMAs read the 64 from sB on).
template <u32 LBO = (WGR_N / 8) * 128>
__device__ __forceinline__ void wgr_group_sums(float (&a)[32], const u32 (&af)[G][4],
                                               const u8 *sB, const bool one, const bool fx,
                                               const float (&cf)[2][G],
                                               const float (*sqs)[G * H],
                                               const u32 (&esc)[2], const int tig) {
  constexpr u32 lbo = LBO;
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


// ==== query staging and key prefetch ====

// B, the block's query operands in shared memory (wgmma K-major, no swizzle): column n
// (row n / H, head n % H), group g: the word of dims 32 g + 8 tt .. + 7 -> bytes 4 tt of
// chunk 2 g (dims + 0..3) and of chunk 2 g + 1 (dims + 4..7), doubled E2M1 values as
// E4M3 bytes, times 2^(eq_g - qbase_g) when the queries fold; ROWS rows (columns
// n < ROWS * H). A thread takes whole (column, group) pairs, column fastest across the
// threads: one 16-byte load of the group's codes (q is 16-byte aligned, and a group is 16
// bytes at a multiple of 16) and two 16-byte stores (chunks 2 g and 2 g + 1 of the
// column, a warp's 32 columns contiguous), one pair at a time. LEAN (mqa_logits_wgi8's
// restaging inside its tile loop, where a pair's 16 bytes and their conversion make
// ptxas spill a loop-carried value): one 4-byte word at a time. No barrier: the caller
// fences and syncs.
template <int ROWS = WGR_ROWS, bool LEAN = false, class RowOf>
__device__ __forceinline__ void wgr_stage_queries(const u8 *q, const u8 *q_scale, RowOf row_of,
                                                  const bool fold_q, const int (&qbase)[G],
                                                  const u32 (*stab)[2], u8 *sB, const int tid) {
  constexpr int NC = ROWS * H;
  if constexpr (LEAN) {
    for (int t = tid; t < NC * G * 4; t += WGR_THREADS) {
      const int n = t / (G * 4), g = (t / 4) % G, tt = t % 4;
      const u64 qrow = (u64)row_of(n / H) * H + n % H;
      const int sh = fold_q ? (int)q_scale[qrow * G + g] - qbase[g] : 0;
      const u32 word = *reinterpret_cast<const u32 *>(q + qrow * (D / 2) + 16 * g + 4 * tt);
      u32 lo, hb;
      e2m1_word_tab(word, stab[sh + 9][0], stab[sh + 9][1], lo, hb);
      *reinterpret_cast<u32 *>(&sB[wg_off(n, 2 * g, NC) + 4 * tt]) = lo;
      *reinterpret_cast<u32 *>(&sB[wg_off(n, 2 * g + 1, NC) + 4 * tt]) = hb;
    }
    return;
  }
#pragma unroll 1
  for (int t = tid; t < NC * G; t += WGR_THREADS) {
    const int n = t % NC, g = t / NC;
    const u64 qrow = (u64)row_of(n / H) * H + n % H;
    int qb = qbase[0];
#pragma unroll
    for (int gg = 1; gg < G; ++gg) qb = g == gg ? qbase[gg] : qb;
    const int sh = fold_q ? (int)q_scale[qrow * G + g] - qb : 0;
    const uint4 word = *reinterpret_cast<const uint4 *>(q + qrow * (D / 2) + 16 * g);
    const u32 t0 = stab[sh + 9][0], t1 = stab[sh + 9][1];
    uint4 lo, hb;
    e2m1_word_tab(word.x, t0, t1, lo.x, hb.x);
    e2m1_word_tab(word.y, t0, t1, lo.y, hb.y);
    e2m1_word_tab(word.z, t0, t1, lo.z, hb.z);
    e2m1_word_tab(word.w, t0, t1, lo.w, hb.w);
    *reinterpret_cast<uint4 *>(&sB[wg_off(n, 2 * g, NC)]) = lo;
    *reinterpret_cast<uint4 *>(&sB[wg_off(n, 2 * g + 1, NC)]) = hb;
  }
}

// This thread's keys in a tile are 16 warp + gid + 8 kk, kk < 2: raw[kk][g] their codes
// (one word per group), rsc[kk] their scale bytes packed (group g in byte g), none[kk]
// past the group's keys. (Three arrays, not a struct: a struct's fields reorder the key
// loop's register moves in mqa_logits_wgr's PTX.)

// A key past the group's: scale bytes 127 (2^0; see wgr_tile's one-multiply form).
#define WGR_NONE_SC (G == 4 ? 0x7F7F7F7Fu : G == 2 ? 0x7F7Fu : 0x7Fu)

// Loads this thread's keys of tile c (flat keys from ks, nkeys of them in the group;
// paged keys through the page table).
// sc_word: the scale bytes of a key in one load (G = 4: u32, G = 2: u16), for k_scale8
// G-byte aligned (a uniform branch: always for the host backend's uploads), else byte by
// byte (the engine's device inputs may start anywhere).
__device__ __forceinline__ void wgr_prefetch(u32 (&raw)[2][G], u32 (&rsc)[2], bool (&none)[2],
                                             const u8 *k, const u8 *k_scale8,
                                             const u32 ks, const u32 nkeys, const u32 c,
                                             const bool sc_word, const int warp, const int gid,
                                             const int tig PG_DECL) {
  const u32 j = c * WGR_KEYS + 16 * warp + gid;  // key kk = 0; kk = 1 is j + 8
#if !DSA_PAGED
  const u8 *kp = k + (u64)(ks + j) * (D / 2) + 4 * tig;
  const u8 *sp = k_scale8 + (u64)(ks + j) * G;
#endif
#pragma unroll
  for (int kk = 0; kk < 2; ++kk) {
    none[kk] = j + 8 * kk >= nkeys;
#if DSA_PAGED
    // Key j + 8 kk through the page table (key 0 of the group's request for a key past
    // the group's, whose entry is a used one; nothing is loaded for it).
    const PagedKey pk = paged_key(k, page_table, ks, none[kk] ? 0u : j + 8 * kk, page_log2);
#define WGR_KP (pk.code + 4 * tig)
#define WGR_SP (pk.scale)
#else
#define WGR_KP (kp + 8 * kk * (D / 2))
#define WGR_SP (sp + 8 * kk * G)
#endif
    rsc[kk] = WGR_NONE_SC;
    if (!none[kk]) {
      if (sc_word) {
        rsc[kk] = G == 4 ? *reinterpret_cast<const u32 *>(WGR_SP)
                            : (u32)*reinterpret_cast<const unsigned short *>(WGR_SP);
      } else {
        rsc[kk] = 0u;
#pragma unroll
        for (int g = 0; g < G; ++g) rsc[kk] |= (u32)WGR_SP[g] << (8 * g);
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g)
      raw[kk][g] = none[kk] ? 0u : *reinterpret_cast<const u32 *>(WGR_KP + 16 * g);
#undef WGR_KP
#undef WGR_SP
  }
}

// ==== one key tile, fp8 ====

// One key tile of mqa_logits_wgr from this thread's keys (raw, rsc): the per-key
// constants, the E4M3 A fragments, then next() (the next tile's prefetch, which may
// overwrite raw and rsc, and overlaps the MMAs), the group sums and the head sum. Returns the logit of this
// thread's row (tig bit 1) and key (16 warp + gid, + 8 on odd lanes); sets two_mul when
// the tile ran the two multiplies. PIN_A: the A fragments are computed before next() and
// the MMAs' fence (else the compiler may sink some decodes past the fence, and ptxas then
// inserts a warpgroup arrive, which in a branch it cannot prove uniform serializes every
// wgmma of the kernel: mqa_logits_wgi8's fallback tile). LBO as in wgr_group_sums (sB,
// sqs and sw then point at the two rows' part of a wider block's).
template <bool PIN_A = false, u32 LBO = (WGR_N / 8) * 128, class Next>
__device__ __forceinline__ float wgr_tile(const u32 (&raw)[2][G], const u32 (&rsc)[2],
                                          const u8 *sB, const bool fold_q,
                                          const bool qsafe, const float (*sqs)[G * H],
                                          const float (*sw)[H], const u32 (*stab)[2],
                                          bool &two_mul, const int tig, const bool odd,
                                          const bool hi, Next next) {
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
  if (PIN_A) fence_regs_a(af);
  next();

  float a[32];
  wgr_group_sums<LBO>(a, af, sB, one, fx, cf, sqs, esc, tig);
  return two_row_head_sum<4>(a, sw, tig, odd, hi);
}
