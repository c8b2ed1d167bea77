// mqa_logits_wgi8: SPEC 4's logits of the exact class (E2M1 x E2M1) for H = 32 and
// D >= 64 on s8 wgmma where a tile's scales and the block's weights admit it, else
// mqa_logits_wgr's tile (on each pair of the block's rows).
// Compiled after common.cuh, logits_common.cuh and logits_wgr.cuh (the fallback tile,
// its prologue and key prefetch), for those variants only (the no_int8_exact hook runs
// mqa_logits_wgr instead).
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
//   queries (once per block, its R x 32 (row, head) vectors): every vector spans <= 3, and
//   q_hi <= 244 (q_lo, q_hi: the smallest and largest byte of the block);
//   keys (per tile, each key of the tile in the group): its bytes span <= 3,
//   ek_min + q_lo >= 107 and ek_max + q_hi <= 369 (G = 4) or 370 (G = 2).
// It implies every condition above for every (vector, key) pair of the tile:
// eq_min + ek_min >= q_lo + ek_min >= 107 (E >= -149, and E <= 369 - 256 < 127),
// eq_g <= q_hi <= 244, e_g <= q_hi + ek_max. It is docs/numerics.md's block guard (there
// derived with the cases that make each bound necessary). A tile it rejects runs
// mqa_logits_wgr's arithmetic on that kernel's B staging (folded when the queries fold;
// the layout below says where it is staged), so both paths are bitwise SPEC 4 and a
// tile's path changes no bit.
//
// ==== the head epilogue, and when it is bitwise ====
//
// The int8 path gives a_h = Y_h 2^E_h exactly (above), E_h = eq_min,h + ek_min - 256.
// SPEC 4 then takes term_h = w_h * relu(a_h) and logit = P(term_0 .. term_31). With
// cq_h = 2^(eq_min,h - 129) and ck = 2^(ek_min - 127) (so a_h = Y_h cq_h ck), the fma
// form (docs/numerics.md 6.7, the kernel's before the subnormal form below, which rests on
// its guard) computes, per (row, key):
// - v_h = w_h * cq_h once per block (per column), and m_h = v_h * -2^23 (= -v_h * 2^23);
// - x_h = 2^23 + max(Y_h, 0) as the bits of max(acc, 0x4B000000), the accumulator having
//   started at 0x4B000000 (2^23 as an f32; |Y| < 2^21, so acc = 0x4B000000 + Y and, for
//   Y >= 0, the f32 2^23 + Y);
// - T_h = fma(v_h, x_h, m_h), one rounding of v_h relu(Y_h) (m_h is exactly -v_h 2^23);
// - L = P(T_0 .. T_31) * ck, then -0 for a zero L when every w_h of the row has its sign
//   bit set.
// That is three operations per (row, head, key) (IMNMX, FFMA, FADD) against the two
// roundings per group and the head sum's relu and weight of mqa_logits_wgr's tile.
// It equals SPEC 4 bit for bit when, with f(v) the biased exponent field of v,
//   f_lo >= 24 (f_lo: the smallest f(v_h) over the block's columns with w_h != 0),
//   f_hi <= 227 (the largest over all columns), and for every key of the tile
//   ek_min >= 151 - f_lo and ek_min <= 354 - f_hi:
// - v_h is exact (w_h * cq_h is 0 or at least 2^-103: normal), and so is m_h
//   (|v_h| 2^23 < 2^124).
// - Y_h <= 0: SPEC 4's term is w_h * +0, a zero; T_h = fma(v, 2^23, -v 2^23) = +0.
// - Y_h > 0, w_h != 0: the reals r = v_h Y_h and r ck = w_h a_h both lie in
//   [2^-103, 2^127) (|v_h| >= 2^-103, |v_h| ck >= 2^(f_lo - 127 + ek_min - 127) >=
//   2^-103, |v_h| < 2^101, |v_h| ck < 2^101, Y_h < 2^21), the normal range, where
//   rounding commutes with a power of two: SPEC 4's term_h = RN(r ck) = RN(r) ck = T_h ck.
// - The sums: every nonzero T_h and T_h ck is at least 2^-103, hence a multiple of
//   2^-126, and so is every partial sum of P on either side; a nonzero one is thus
//   normal, and below 32 * 2^122 = 2^127: each addition rounds the same real on both
//   sides up to the factor ck. So SPEC 4's logit is P(T) ck as a value, and the final
//   multiply is exact.
// - Zeros: P(T) is never -0 (no T_h is -0). SPEC 4's logit is -0 iff every term_h is
//   -0, which (with the values equal) happens iff the logit is 0 and every w_h has its
//   sign bit set: then no term is positive, a negative one would leave a negative sum,
//   and every zero term is w_h * (+0) = -0.
// The guard is evaluated once per block (f_lo, f_hi) and per key beside the int8 guard;
// docs/numerics.md section 6.7 has it with the host model's checks.
//
// The kernel (docs/numerics.md 6.8) reads the sums as subnormals instead: with
// s = 254 - f_hi, v'_h = v_h 2^s once per block (an exponent-field add),
// x_h = the bits of max(Y_h, 0) (max(Y_h, 0) 2^-149), T'_h = v'_h * x_h, and
// L = P(T') * 2^(ek_min + f_hi - 232): an integer max and a multiply per (row, head,
// key), no m_h and no sign rule (a zero T'_h carries w_h's sign, as SPEC 4's w_h * (+0)
// does). Every T'_h is SPEC 4's term times one power of two when, beside the guard
// above, f_hi - f_lo <= 104 (each nonzero T'_h then normal); the sums and the final
// multiply follow.

// ==== layout ====
//
// R rows per block, in two entries of one module: mqa_logits_wgi8 (R = 4) and
// mqa_logits_wgi8_r8 (R = 8); the host picks one per launch (the eight-row form where the
// launch's row groups hold more than four rows on average: prefill; the four-row one for
// decode, whose groups hold one to four rows). B has 32 columns per row, and within a row
// column n' = 8 a + 2 t + e (a < 4, t < 4, e < 2) holds head e + 2 a + 8 t.
// The s8 MMAs run on 128 columns (four rows) at a time, one s32 accumulator of 64
// elements each: element i of a thread is key 16 warp + gid + 8 ((i >> 1) & 1), column
// 8 (i >> 2) + 2 tig + (i & 1) of its four rows. So a thread holds, per row and key, the
// heads of head bits 0..2 (e, a), and the lanes of its quad hold bits 3 and 4 (tig):
// SPEC 4's pairwise head sum is three levels in the thread and two across the quad.
// With eight rows the second four rows' MMAs run while the first four's epilogue does,
// from the same keys (pre-decoded over flat keys and read from shared memory, below;
// decoded once per eight rows into A fragments over paged keys).
// The fallback (mqa_logits_wgr's tile on each pair of rows) reads mqa_logits_wgr's
// staging of the rows (heads in their natural order): all of them in sQ when the block's
// queries or weights are rejected (sQ then holds no s8 operands), else one pair at a
// time in sF, staged when a key tile is rejected.
// Rows per s8 MMA (128 columns).
#define WGI8_MMA_ROWS 4
static_assert(WGI8_MMA_ROWS * H == WGR_THREADS, "one column per thread per MMA in the prologue");

// Blocks per SM the registers must allow: at four rows 3 at D = 128 (168 registers) and
// 4 at D = 64; at eight rows 3 (168 registers and no spills at D = 128 over pre-decoded
// keys, whose MMAs read A from shared memory: the s8 wgmma stays pipelined; the in-block
// decode's A fragments leave ptxas to serialize it, C7512).
#ifndef WGI8_MIN_BLOCKS
#define WGI8_MIN_BLOCKS (G == 4 ? 3 : 4)
#endif
#ifndef WGI8_R8_MIN_BLOCKS
#define WGI8_R8_MIN_BLOCKS 3
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
// The head epilogue's: f_lo >= 24, f_hi <= 227, ek_min + f_lo >= 151, ek_min + f_hi <= 354.
#define I8_MIN_V_EXP 24
#define I8_MAX_V_EXP 227
#define I8_MIN_VK_EXP 151
#define I8_MAX_VK_EXP 354
static_assert(G == 2 || G == 4, "mqa_logits_wgi8: D = 64 or 128");

// Packed window for one min-reduction (__vminu4): byte 0 the smallest byte, byte 1 255 -
// the largest, byte 2 1 while every vector spans <= I8_MAX_SPAN. A thread without a
// vector holds the neutral 0x0001FFFF.
#define I8_QWIN_NONE 0x0001FFFFu

// svm, the head epilogue's block constants: each column's v' (float2 p = columns 2 p,
// 2 p + 1), one 8-byte shared load per four heads (the loop's shared-memory pipe, which
// the wgmma's operand reads share, is its busiest unit). The epilogue reads the sums as
// subnormal operands (docs/numerics.md 6.8: per head an integer max and a multiply, the
// weights' constants pre-scaled by 2^(254 - f_hi), no sign rule, and the int8 path's
// logits stored without the NaN check, as none can be NaN).
// The subnormal form's bound on the block's weights: f_hi - f_lo <= 104 (every nonzero
// term then normal).
#define I8_MAX_V_SPREAD 104

// ==== one key tile, int8 ====

// The head epilogue of four rows (r0 .. r0 + 3) from their accumulator y (the s32 head
// sums Y): the logits of rows r0 + hi and r0 + 2 + hi at this thread's key kk = odd,
// into out[0], out[1]; ck: that key's scale (docs/numerics.md 6.8: 2^(ek_min + f_hi -
// 232)).
__device__ __forceinline__ void wgi8_epilogue(const int (&y)[64], const float2 *svm, const int r0,
                                              const float ck, const int tig, const bool odd,
                                              const bool hi, float (&out)[2]) {
  // Per row r and key kk: head bits 0..2 in the thread (e, then a's two bits).
  float p[WGI8_MMA_ROWS][2];
#pragma unroll
  for (int r = 0; r < WGI8_MMA_ROWS; ++r) {
    float s1[2][4];
#pragma unroll
    for (int a = 0; a < 4; ++a) {
      const int j = 4 * r + a;
      // svm holds v' = v 2^s; the bits of max(Y, 0) read as an f32 are max(Y, 0) 2^-149.
      const float2 c = svm[4 * (4 * r0 + j) + tig];
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {
        const int i = 4 * j + 2 * kk;
        const float x0 = __int_as_float(max(y[i], 0));
        const float x1 = __int_as_float(max(y[i + 1], 0));
        s1[kk][a] = __fadd_rn(__fmul_rn(c.x, x0), __fmul_rn(c.y, x1));
      }
    }
#pragma unroll
    for (int kk = 0; kk < 2; ++kk)
      p[r][kk] = __fadd_rn(__fadd_rn(s1[kk][0], s1[kk][1]), __fadd_rn(s1[kk][2], s1[kk][3]));
  }
  // Head bit 3 (lane offset 1): odd lanes keep key gid + 8, even lanes key gid.
  float q[WGI8_MMA_ROWS];
#pragma unroll
  for (int r = 0; r < WGI8_MMA_ROWS; ++r) {
    const float send = odd ? p[r][0] : p[r][1];
    q[r] = __fadd_rn(odd ? p[r][1] : p[r][0], __shfl_xor_sync(FULL_MASK, send, 1));
  }
  // Head bit 4 (lane offset 2): lanes with tig bit 1 keep rows 1 and 3, the others 0 and 2.
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const float send = hi ? q[2 * rr] : q[2 * rr + 1];
    const float l = __fadd_rn(hi ? q[2 * rr + 1] : q[2 * rr], __shfl_xor_sync(FULL_MASK, send, 2));
    out[rr] = __fmul_rn(l, ck);
  }
}

// One key tile on the int8 path: per four rows one s32 chain of G k32 steps against B
// (db0: the descriptor of sQ's s8 operands, whose steps are fixed offsets from it),
// mma(y, g, db, scale_d) issuing step g of one chain with B descriptor db (A, the tile's
// keys with each key's values shifted by its group's offset from kmin[kk], its smallest
// byte, comes from the caller), and the head epilogue above with the block's columns'
// constants in svm. Writes the logits of rows 4 m + hi and 4 m + 2 + hi (out[2 m],
// out[2 m + 1]) at key 16 warp + gid + 8 odd; ec, the block's epilogue constant
// f_hi - 105, the key's scale being 2^(ek_min + ec - 127) (its exponent field clamped to
// at least 1, which only a block without a nonzero weight reaches: its logits are zeros
// whatever the scale).
template <int R, class Mma>
__device__ __forceinline__ void wgi8_tile_mma(Mma mma, const int (&kmin)[2], const u64 db0,
                                              const float2 *svm, const u32 ec, const int tig,
                                              const bool odd, const bool hi,
                                              float (&out)[R / 2]) {
  constexpr u32 lbo = (R * H / 8) * 128;
  constexpr int M = R / WGI8_MMA_ROWS;
  const float ck = __uint_as_float((u32)max((odd ? kmin[1] : kmin[0]) + (int)ec, 1) << 23);
  int y[M][64];
  wgmma_fence();
#pragma unroll
  for (int m = 0; m < M; ++m) {
#pragma unroll
    for (int g = 0; g < G; ++g)
      mma(y[m], g, wgmma_desc_add(db0, 2 * g * lbo + m * (WGI8_MMA_ROWS * H / 8) * 128),
          g > 0 ? 1u : 0u);
    wgmma_commit();
  }
  // Four rows' epilogue while the next four rows' MMAs run.
#pragma unroll
  for (int m = 0; m < M; ++m) {
    if (m + 1 < M)
      wgmma_wait<1>();
    else
      wgmma_wait<0>();
    fence_regs_s32(y[m]);
    float o[2];
    wgi8_epilogue(y[m], svm, WGI8_MMA_ROWS * m, ck, tig, odd, hi, o);
    out[2 * m] = o[0];
    out[2 * m + 1] = o[1];
  }
}

// The same tile from this thread's s8 A fragments af (its two keys): then next() (the
// next tile's prefetch), and the MMAs read A from af.
template <int R, class Next>
__device__ __forceinline__ void wgi8_tile_af(u32 (&af)[G][4], const int (&kmin)[2],
                                             const u64 db0, const float2 *svm, const u32 ec,
                                             const int tig, const bool odd, const bool hi,
                                             float (&out)[R / 2], Next next) {
  fence_regs_a(af);
  next();
  wgi8_tile_mma<R>(
      [&](int (&y)[64], const int g, const u64 db, const u32 scale_d) {
        wgmma_m64n128k32_s8_rs(y, af[g], db, scale_d);
      },
      kmin, db0, svm, ec, tig, odd, hi, out);
}

// The same tile from this thread's fp4 keys (raw, rsc): the s8 A fragments decoded here.
template <int R, class Next>
__device__ __forceinline__ void wgi8_tile(const u32 (&raw)[2][G], const u32 (&rsc)[2],
                                          const int (&kmin)[2], const u64 db0,
                                          const float2 *svm, const u32 ec, const int tig,
                                          const bool odd, const bool hi,
                                          float (&out)[R / 2], Next next) {
  u32 af[G][4];
#pragma unroll
  for (int kk = 0; kk < 2; ++kk)
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const int sk = (int)((rsc[kk] >> (8 * g)) & 0xFFu) - kmin[kk];
      e2m1_word_s8(raw[kk][g], sk, af[g][kk], af[g][2 + kk]);
    }
  wgi8_tile_af<R>(af, kmin, db0, svm, ec, tig, odd, hi, out, next);
}

// ==== pre-decoded keys ====
//
// The eight-row entry over flat keys (WGI8_PRE) reads each key's s8 operands from k8,
// which wgi8_decode_keys writes once before the launches, instead of decoding them in
// every block: the decode (about 200 instructions per warp and key tile) is then paid
// once per key, not once per key and row group. k8 holds D bytes per key, in the order of
// the k positions of the MMAs' A: k32 step g at bytes 32 g .. 32 g + 31, where byte
// 32 g + 4 t + i holds value 8 t + i of group g and byte 32 g + 16 + 4 t + i value
// 8 t + 4 + i (t < 4, i < 4: the order in which sQ holds the queries' values), each
// shifted by g's offset from the key's smallest byte. kinfo holds per key its smallest
// scale byte (byte 0) and its largest (byte 1). A key whose bytes span more than
// I8_MAX_SPAN has zero operands: the guard sends every tile that holds it to the fallback,
// which reads the fp4 keys.
//
// The block's thread 0 copies each key tile's 64 rows of k8 into shared memory by TMA
// (the host's map: boxes of 64 rows of D bytes, swizzled at D bytes, wgmma's K-major A
// layout), WGI8_RING - 1 tiles ahead of the one computed, into a ring of WGI8_RING tiles;
// tile i lands in ring tile i % WGI8_RING and completes phase i / WGI8_RING of its `full`
// mbarrier, which every thread waits for. The MMAs then read A from there: no key byte
// takes a register (the rs form held 4 G fragment words a thread, and as many for the
// next tile's prefetch). A ring tile is refilled after the barrier of the guard of a
// later tile, which every thread reaches only after its MMAs of the ring tile's last
// tile have completed (wgmma_wait<0> in wgi8_tile_mma; a fallback tile reads no ring
// tile). Rows past the buffer read as zeros, and rows of the next request's keys are
// read too: the logits of neither are stored, and the guard ignores their windows.
#ifndef WGI8_PREDECODE
#define WGI8_PREDECODE 1
#endif
#define WGI8_PRE (WGI8_PREDECODE && !DSA_PAGED)
// The window of a key past the group's: bit 16 set (a real key's window has bytes 0 and 1
// alone), which the guard admits; its kmin 0 scales a logit that is never stored.
#define WGI8_NONE_INFO 0x10000u
// Ring tiles: 2 (one tile in flight while one is computed) or 3.
#ifndef WGI8_RING
#define WGI8_RING 2
#endif
static_assert(WGI8_RING >= 2 && WGI8_RING <= 3, "WGI8_RING: 2 or 3");
// One ring tile: 64 keys of D bytes. The ring is the entry's dynamic shared memory,
// WGI8_RING tiles and 1024 bytes to align it (the host's kernels::wgi8_ring_bytes).
#define WGI8_KTILE_BYTES (WGR_KEYS * D)

// k8 and kinfo of keys [0, nkeys), four threads per key: thread tig writes the words of
// values 8 tig .. 8 tig + 3 and 8 tig + 4 .. 8 tig + 7 of each group.
extern "C" __global__ void __launch_bounds__(256) wgi8_decode_keys(
    const u8 *__restrict__ k, const u8 *__restrict__ k_scale8, const u32 nkeys,
    u32 *__restrict__ k8, u32 *__restrict__ kinfo) {
  const u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  const u64 x = t >> 2;
  const int tig = (int)(t & 3u);
  if (x >= nkeys) return;
  int e[G], mn = 255, mx = 0;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    e[g] = (int)k_scale8[x * G + g];
    mn = min(mn, e[g]);
    mx = max(mx, e[g]);
  }
  const bool fits = mx - mn <= I8_MAX_SPAN;
  u32 *row = k8 + x * (D / 4);
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const u32 word = *reinterpret_cast<const u32 *>(k + x * (D / 2) + 16 * g + 4 * tig);
    u32 lo = 0u, hb = 0u;
    if (fits) e2m1_word_s8(word, e[g] - mn, lo, hb);
    row[8 * g + tig] = lo;
    row[8 * g + 4 + tig] = hb;
  }
  if (tig == 0) kinfo[x] = (u32)mn | ((u32)mx << 8);
}

// This thread's two keys' scale windows in key tile c (keys 16 warp + gid and + 8 of the
// group's from flat key ks); a key past the group's nkeys reads nothing and takes
// WGI8_NONE_INFO.
__device__ __forceinline__ void wgi8_prefetch_info(u32 (&kinf)[2], const u32 *kinfo,
                                                   const u32 ks, const u32 nkeys, const u32 c,
                                                   const int warp, const int gid) {
  const u32 j = c * WGR_KEYS + 16 * warp + gid;
#pragma unroll
  for (int kk = 0; kk < 2; ++kk)
    kinf[kk] = j + 8 * kk >= nkeys ? WGI8_NONE_INFO : kinfo[(u64)ks + j + 8 * kk];
}

// Thread 0: key tile c's 64 rows of k8 (from flat key ks + 64 c) into ring tile `tile`,
// completing on `bar`.
__device__ __forceinline__ void wgi8_tma_issue(u8 *tile, u64 *bar, const TmaDesc *k8map,
                                               const u32 ks, const u32 c) {
  tma_load_2d_expect_if(true, tile, k8map, bar, WGI8_KTILE_BYTES, 0, (int)(ks + c * WGR_KEYS));
}

// Counts a block's tiles on each path (thread 0; every thread calls it).
__device__ __forceinline__ void count_int8_tiles(u32 *paths, const u32 n_i8, const u32 n_fb) {
  if (paths == nullptr || threadIdx.x != 0) return;
  if (n_i8) atomicAdd(&paths[LG_PATH_I8], n_i8);
  if (n_fb) atomicAdd(&paths[LG_PATH_I8_FALLBACK], n_fb);
}

// ==== kernel ====

// The kernel's arguments, and their names in the call of its body.
#define WGI8_PARAMS                                                                            \
  const u8 *__restrict__ q, const u8 *__restrict__ q_scale, const u8 *__restrict__ k,          \
      const u8 *__restrict__ k_scale8, const float *__restrict__ k_scale32,                    \
      const float *__restrict__ w, const u32 *__restrict__ row_n,                              \
      const u32 *__restrict__ row_ks, const u64 *__restrict__ row_off,                         \
      const uint4 *__restrict__ groups, u32 group0, float *__restrict__ logits,                \
      u32 *__restrict__ paths LG_PAGED_PARAMS
#define WGI8_ARGS \
  q, q_scale, k, k_scale8, k_scale32, w, row_n, row_ks, row_off, groups, group0, logits, paths PG_PASS
// The eight-row entry's pre-decoded keys (WGI8_PRE: flat keys), its two last parameters:
// their scale windows, and the TMA map of their s8 operands.
#if WGI8_PRE
#define WGI8_PRE_PARAMS , const u32 *__restrict__ kinfo, const __grid_constant__ TmaDesc k8map
#define WGI8_PRE_ARGS , kinfo, &k8map
#else
#define WGI8_PRE_PARAMS
#define WGI8_PRE_ARGS , nullptr, nullptr
#endif

// block: rows grp.x + [0, R) x 32 heads x keys 64 c + [0, 64) -> logits[row, key]
// (grp = groups[group0 + blockIdx.y], one warpgroup; c = blockIdx.x, + gridDim.x, ...)
template <int R>
__device__ __forceinline__ void wgi8_block(WGI8_PARAMS, const u32 *__restrict__ kinfo,
                                           const TmaDesc *k8map) {
  static_assert(R == 4 || R == 8, "mqa_logits_wgi8: 4 or 8 rows per block");
  constexpr int N = R * H;  // B's columns
  __shared__ __align__(128) u8 sQ[N * D];
  __shared__ __align__(128) u8 sF[WGR_N * D];
  __shared__ __align__(16) float2 svm[N / 2];
  __shared__ __align__(8) float sqs[R][G * H];
  __shared__ __align__(8) float sw[R][H];
  __shared__ u32 stab[15][2];
  __shared__ u32 swq[2][WGR_THREADS / 32];
  __shared__ u32 sqwin[WGR_THREADS / 32];
  __shared__ u32 svwin[WGR_THREADS / 32];
  __shared__ __align__(16) RowOut srow[R];
  // The int8 path's keys: pre-decoded, by TMA into the ring (the dynamic shared memory),
  // in the eight-row entry over flat keys; else the fp4 keys, decoded per tile.
  constexpr bool PRE = R == 8 && WGI8_PRE;
  extern __shared__ __align__(16) u8 sdyn[];
  __shared__ __align__(8) u64 kfull[WGI8_RING];

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
      wgr_prologue<R>(q_scale, w, row_of, sw, sqs, stab, swq[0], swq[1], qbase, tid, lane, warp);
  bool qsafe = fold_q;
#pragma unroll
  for (int g = 0; g < G; ++g) qsafe = qsafe && qbase[g] >= 107 && qbase[g] <= 129;

  // Thread tid takes column 128 m + tid (row 4 m + warp, head e + 2 a + 8 t of n' = lane =
  // 8 a + 2 t + e) of each four rows m: its vector's window (span, cq = 2^(eq_min - 129)),
  // v = w cq and the exponent window of v. The windows are reduced over the block after a
  // barrier.
  const auto head_of = [](int n) { return (n & 1) + 2 * ((n >> 3) & 3) + 8 * ((n >> 1) & 3); };
  {
    u32 qwin = I8_QWIN_NONE, vwin = 0x0000FFFFu;
#pragma unroll
    for (int m = 0; m < R / WGI8_MMA_ROWS; ++m) {
      const int r = WGI8_MMA_ROWS * m + warp, hh = head_of(lane), n = WGR_THREADS * m + tid;
      const u64 qrow = (u64)row_of(r) * H + hh;
      u32 mn = 255u, mx = 0u;
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const u32 e = q_scale[qrow * G + g];
        mn = min(mn, e);
        mx = max(mx, e);
      }
      const float wv = sw[r][hh];
      const float v = __fmul_rn(wv, ue8m0_pow2(mn, 2));
      reinterpret_cast<float *>(svm)[n] = v;
      qwin = __vminu4(qwin, mn | ((255u - mx) << 8) | ((mx - mn <= I8_MAX_SPAN ? 1u : 0u) << 16));
      const u32 f = (__float_as_uint(v) >> 23) & 0xFFu;
      // byte 0: f over the columns with a nonzero weight (255: none), byte 1: 255 - f.
      vwin = __vminu4(vwin, (wv != 0.0f ? f : 255u) | ((255u - f) << 8));
    }
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      qwin = __vminu4(qwin, __shfl_xor_sync(FULL_MASK, qwin, o));
      vwin = __vminu4(vwin, __shfl_xor_sync(FULL_MASK, vwin, o));
    }
    if (lane == 0) {
      sqwin[warp] = qwin;
      svwin[warp] = vwin;
    }
  }
  // Each row's logits and visible keys (none past the group's rows), for the stores.
  if (tid < R) srow[tid] = row_out(logits, row_off, row_n, grp, (u32)tid);
  if (PRE && tid == 0) {
#pragma unroll
    for (int i = 0; i < WGI8_RING; ++i) mbar_init(&kfull[i], 1);
    fence_mbar_init();
  }
  __syncthreads();
  u32 bwin = sqwin[0], vwin = svwin[0];
#pragma unroll
  for (int i = 1; i < WGR_THREADS / 32; ++i) {
    bwin = __vminu4(bwin, sqwin[i]);
    vwin = __vminu4(vwin, svwin[i]);
  }
  const int q_lo = (int)(bwin & 0xFFu), q_hi = 255 - (int)((bwin >> 8) & 0xFFu);
  const int f_lo = (int)(vwin & 0xFFu), f_hi = 255 - (int)((vwin >> 8) & 0xFFu);
  const bool q_i8 = ((bwin >> 16) & 0xFFu) != 0u && q_hi <= I8_MAX_Q_EXP &&
                    f_lo >= I8_MIN_V_EXP && f_hi <= I8_MAX_V_EXP &&
                    f_hi - f_lo <= I8_MAX_V_SPREAD;
  // The subnormal form: this thread's columns' v scaled to v' = v 2^(254 - f_hi), an add
  // to the exponent field of each nonzero v (normal: f(v) >= f_lo >= 24, and
  // f(v) + 254 - f_hi <= 254); read by the tile loop after the barrier below.
  if (q_i8) {
#pragma unroll
    for (int m = 0; m < R / WGI8_MMA_ROWS; ++m) {
      float *vp = reinterpret_cast<float *>(svm) + WGR_THREADS * m + tid;
      const float v = *vp;
      if (v != 0.0f) *vp = __uint_as_float(__float_as_uint(v) + ((u32)(254 - f_hi) << 23));
    }
  }
  const u32 ec = (u32)(f_hi - 105);
  // The key side of both guards as bounds on a key's smallest and largest byte.
  const int k_floor = max(I8_MIN_EXP_SUM - q_lo, I8_MIN_VK_EXP - f_lo);
  const int k_cap = I8_MAX_EXP_SUM - q_hi, kmin_cap = I8_MAX_VK_EXP - f_hi;
  // skb[3]: ec, read per tile beside the bounds (one 16-byte load) rather than held in a
  // register across the loop.
  __shared__ __align__(16) int skb[4];
  if (tid == 0) skb[3] = (int)ec;
  if (tid == 0) {
    skb[0] = k_floor;
    skb[1] = k_cap;
    skb[2] = kmin_cap;
  }

  if (q_i8) {
    // sQ: the s8 operands, each word's values shifted by sq_g = eq_g - eq_min (every
    // vector spans <= 3 here), in the columns' head order above. Thread tid takes columns
    // n = 128 m + tid, all G groups of each: its vector's scale bytes and one 16-byte load
    // per group (q is 16-byte aligned), all issued before the first conversion, then two
    // 16-byte stores per group (a warp's 32 columns contiguous in each chunk). One column
    // at a time: both at once hold 40 registers, and ptxas spills in the tile loop.
    static_assert(N % WGR_THREADS == 0, "whole columns per thread");
#pragma unroll 1
    for (int m = 0; m < N / WGR_THREADS; ++m) {
      const int n = WGR_THREADS * m + tid;
      const u64 qrow = (u64)row_of(n / H) * H + head_of(n % H);
      uint4 word[G];
      int esc[G];
#pragma unroll
      for (int g = 0; g < G; ++g) {
        esc[g] = (int)q_scale[qrow * G + g];
        word[g] = *reinterpret_cast<const uint4 *>(q + qrow * (D / 2) + 16 * g);
      }
      int mn = esc[0];
#pragma unroll
      for (int g = 1; g < G; ++g) mn = min(mn, esc[g]);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const int sq = esc[g] - mn;
        uint4 lo, hb;
        e2m1_word_s8(word[g].x, sq, lo.x, hb.x);
        e2m1_word_s8(word[g].y, sq, lo.y, hb.y);
        e2m1_word_s8(word[g].z, sq, lo.z, hb.z);
        e2m1_word_s8(word[g].w, sq, lo.w, hb.w);
        *reinterpret_cast<uint4 *>(&sQ[wg_off(n, 2 * g, N)]) = lo;
        *reinterpret_cast<uint4 *>(&sQ[wg_off(n, 2 * g + 1, N)]) = hb;
      }
    }
  } else {
    // sQ: mqa_logits_wgr's staging of all the rows, for the fallback alone.
    wgr_stage_queries<R>(q, q_scale, row_of, fold_q, qbase, stab, sQ, tid);
  }
  fence_proxy_async();
  __syncthreads();

  u32 raw[2][G], rsc[2];
  bool none[2];
  const bool sc_word = (G == 4 || G == 2) &&
                       (reinterpret_cast<size_t>(k_scale8) & (size_t)(G - 1)) == 0;
  // Pre-decoded keys: this thread's keys' scale windows (kinf), the ring's first tile
  // (1024-byte aligned) and the ring tile and phase of the block's current key tile.
  u32 kinf[2];
  u8 *const ring = sdyn + ((1024u - (smem_u32(sdyn) & 1023u)) & 1023u);
  // The MMAs' descriptors, each step a fixed offset from these (wgmma_desc_add): B, the
  // queries' s8 operands in sQ; A over pre-decoded keys, the ring's first tile.
  const u64 dq = wgmma_desc(sQ, (N / 8) * 128, 128), dring = wgmma_desc_swz(ring, D);
  u32 slot = 0, phase = 0;
  bool two_mul = false;  // some fallback tile ran the two multiplies
  // The block's tiles that fell back (the others took the int8 path): the common path
  // carries no counter.
  u32 n_fb = 0u;
  auto prefetch_raw = [&](const u32 c) {
    if (c < nchunks)
      wgr_prefetch(raw, rsc, none, k, k_scale8, ks, grp.z, c, sc_word, warp, gid, tig PG_PASS);
  };
  // The first tile's keys (blockIdx.x < nchunks): over pre-decoded keys their windows,
  // and thread 0 starts the ring's copies.
  if (PRE && q_i8) {
    wgi8_prefetch_info(kinf, kinfo, ks, grp.z, blockIdx.x, warp, gid);
    if (tid == 0) {
#pragma unroll
      for (int i = 0; i < WGI8_RING - 1; ++i) {
        const u32 ci = blockIdx.x + i * gridDim.x;
        if (ci < nchunks)
          wgi8_tma_issue(ring + i * WGI8_KTILE_BYTES, &kfull[i], k8map, ks, ci);
      }
    }
  } else {
    prefetch_raw(blockIdx.x);
  }
  // mqa_logits_wgr's tile on each pair of rows, staged in sF in turn (the barriers: every
  // thread's MMAs on the last pair are done before sF is restaged), the last pair's with
  // the prefetch; over pre-decoded keys the tile's fp4 keys are read here first.
  auto fallback_tile = [&](const u32 c, const u32 j0) {
    if constexpr (PRE) prefetch_raw(c);
#pragma unroll 1
    for (int pr = 0; pr < R / WGR_ROWS; ++pr) {
      __syncthreads();
      wgr_stage_queries<WGR_ROWS, true>(
          q, q_scale, [&](u32 r) { return row_of(WGR_ROWS * pr + r); }, fold_q, qbase, stab, sF,
          tid);
      fence_proxy_async();
      __syncthreads();
      const bool last = pr + 1 == R / WGR_ROWS;
      const float logit =
          wgr_tile<true>(raw, rsc, sF, fold_q, qsafe, sqs + WGR_ROWS * pr, sw + WGR_ROWS * pr,
                         stab, two_mul, tig, odd, hi, [&] {
                           if (!PRE && last) prefetch_raw(c + gridDim.x);
                         });
      store_row_logit(srow[WGR_ROWS * pr + (hi ? 1 : 0)], j0 + 16 * warp + gid, odd, logit);
    }
  };
  if (q_i8) {
    for (u32 c = blockIdx.x; c < nchunks; c += gridDim.x) {
      const u32 j0 = c * WGR_KEYS;
      // The key side of the guard for this thread's keys (a key past the group's is never
      // stored: it admits), then over the block (the same answer in every thread).
      int kmin[2];
      bool ok = true;
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {
        int mn, mx;
        if constexpr (PRE) {
          mn = (int)(kinf[kk] & 0xFFu);
          mx = (int)((kinf[kk] >> 8) & 0xFFu);
        } else {
          mn = 255;
          mx = 0;
#pragma unroll
          for (int g = 0; g < G; ++g) {
            const int e = (int)((rsc[kk] >> (8 * g)) & 0xFFu);
            mn = min(mn, e);
            mx = max(mx, e);
          }
        }
        kmin[kk] = mn;
        ok = ok && ((PRE ? kinf[kk] >= WGI8_NONE_INFO : none[kk]) ||
                    (mx - mn <= I8_MAX_SPAN && mn >= skb[0] && mx <= skb[1] && mn <= skb[2]));
      }
      const bool i8 = __syncthreads_and(ok ? 1 : 0) != 0;
      if constexpr (PRE) {
        // Every thread's MMAs of the tiles before this one are done: thread 0 refills the
        // ring tile before this one's with the tile WGI8_RING - 1 ahead. Then the next
        // tile's windows, and this tile's keys landed (waited for on either path, so that
        // every copy completes before its ring tile is refilled).
        if (tid == 0) {
          const u32 cn = c + (WGI8_RING - 1) * gridDim.x;
          const u32 prev = slot == 0 ? WGI8_RING - 1 : slot - 1;
          if (cn < nchunks) {
            wgi8_tma_issue(ring + prev * WGI8_KTILE_BYTES, &kfull[prev], k8map, ks, cn);
          }
        }
        if (c + gridDim.x < nchunks)
          wgi8_prefetch_info(kinf, kinfo, ks, grp.z, c + gridDim.x, warp, gid);
        mbar_wait(&kfull[slot], phase);
      }
      if (i8) {
        float out[R / 2];
        if constexpr (PRE) {
          const u64 da = wgmma_desc_add(dring, slot * WGI8_KTILE_BYTES);
          wgi8_tile_mma<R>(
              [&](int (&y)[64], const int g, const u64 db, const u32 scale_d) {
                wgmma_m64n128k32_s8_ss(y, wgmma_desc_add(da, 32 * g), db, scale_d);
              },
              kmin, dq, svm, (u32)skb[3], tig, odd, hi, out);
        } else {
          wgi8_tile<R>(raw, rsc, kmin, dq, svm, (u32)skb[3], tig, odd, hi, out,
                       [&] { prefetch_raw(c + gridDim.x); });
        }
#pragma unroll
        for (int i = 0; i < R / 2; ++i) {
          // Inside the guard no logit is NaN (docs/numerics.md 6.5): no check.
          const u32 j = j0 + 16 * warp + gid + (odd ? 8 : 0);
          const RowOut o = srow[2 * i + (hi ? 1 : 0)];
          if (j < o.n) o.out[j] = out[i];
        }
      } else {
        ++n_fb;
        fallback_tile(c, j0);
      }
      if (PRE && ++slot == WGI8_RING) {
        slot = 0;
        phase ^= 1u;
      }
    }
  } else {
    // Every tile on mqa_logits_wgr's tile, each pair of rows in turn from sQ (one pair at
    // a time: unrolled, the pairs' tiles interleave and spill).
    for (u32 c = blockIdx.x; c < nchunks; c += gridDim.x) {
#pragma unroll 1
      for (int pr = 0; pr < R / WGR_ROWS; ++pr) {
        const bool last = pr + 1 == R / WGR_ROWS;
        const float logit = wgr_tile<true, (N / 8) * 128>(
            raw, rsc, sQ + pr * (WGR_N / 8) * 128, fold_q, qsafe, sqs + WGR_ROWS * pr,
            sw + WGR_ROWS * pr, stab, two_mul, tig, odd, hi, [&] {
              if (last) prefetch_raw(c + gridDim.x);
            });
        store_row_logit(srow[WGR_ROWS * pr + (hi ? 1 : 0)], c * WGR_KEYS + 16 * warp + gid, odd,
                        logit);
      }
    }
  }
  count_fold_paths(paths, fold_q, two_mul);
  const u32 tiles = (nchunks - 1 - blockIdx.x) / gridDim.x + 1;
  // Without the query side of the guard every tile fell back.
  const u32 n_i8 = q_i8 ? tiles - n_fb : 0u;
  count_int8_tiles(paths, n_i8, tiles - n_i8);
}

// The two forms (the host's kernels::logits_kernel_for picks one per launch).
extern "C" __global__ void __launch_bounds__(WGR_THREADS, WGI8_MIN_BLOCKS) mqa_logits_wgi8(
    WGI8_PARAMS) {
  wgi8_block<4>(WGI8_ARGS, nullptr, nullptr);
}
extern "C" __global__ void __launch_bounds__(WGR_THREADS, WGI8_R8_MIN_BLOCKS) mqa_logits_wgi8_r8(
    WGI8_PARAMS WGI8_PRE_PARAMS) {
  wgi8_block<8>(WGI8_ARGS WGI8_PRE_ARGS);
}
