// logits_common.cuh: what every SPEC 4 logits kernel shares. The host compiles
// common.cuh, the variant's #defines, this file and the one kernel family file that
// serves the variant (cuda::kernels::logits_kernel picks it):
// - mqa_logits_mma.cu: mqa_logits, every variant on mma.sync (the fallback, and
//   WGMMA=0);
// - mqa_logits_wgr.cu: mqa_logits_wgr, the exact class for H = 32, D >= 64 on fp8
//   wgmma with the keys in registers;
// - mqa_logits_wgi8.cu: mqa_logits_wgi8, the same shapes on s8 wgmma where a tile's
//   scales admit it (one exact int32 chain over all groups, one multiply per head
//   score), else mqa_logits_wgr's tile (the int8_exact hook; off by default);
// - mqa_logits_w16.cu: mqa_logits_w16, E4M3 x E4M3 for H = 64 on f16 wgmma (f32
//   accumulation);
// - mqa_logits_w8.cu: mqa_logits_w8, the same on fp8 wgmma with chained k32 steps: the
//   opt-in fast precision, held to SPEC 4's fast-mode bound (see there).
// The two H = 64 kernels share logits_e4m3_h64.cuh, the two H = 32 ones logits_wgr.cuh.
//
// Every kernel takes the same arguments (mqa_logits_mma.cu names them) and computes
// logits[row_off[row] + j] for j < row_n[row] of the rows of one row group per
// blockIdx.y (groups[group0 + blockIdx.y] = (first row, rows, longest row's keys, 0)),
// over key tiles c = blockIdx.x, blockIdx.x + gridDim.x, ... of 64 keys each.
//
// Variant macros (set by the host): DSA_H (heads), DSA_G (groups of 32 dims),
// DSA_QF, DSA_KF (0 = E4M3, 1 = E2M1).
//
// Exact class (E2M1 x E2M1): the MMAs run on doubled values (integers in [-12, 12],
// exact in f16 and in E4M3) with f32 accumulation: every product is an integer <= 144
// and every partial sum an integer below 4608 < 2^13, so 4*s_g comes out exact in f32 in
// any summation order, even from an accumulator that keeps only 13 bits (and the tests
// check it bitwise). t_g = (s_g * 2^(eq-127)) * 2^(ek-127) is computed as
// (4 s_g * 2^(eq-129)) * 2^(ek-127): the same real products, one rounding each, so
// bitwise the reference. (An s8 MMA gives the same 4*s_g but needs an int->f32
// conversion per group: two more epilogue ops.)
//
// Scale folding (exact class, SCALE_FOLD=1, the default): when a block's query group
// scales lie within 15 binades per group (eq <= 244), and a key tile's scales too, the
// operands carry the scales: a doubled E2M1 value times 2^s, s in [-9, 5], is exact in
// E4M3 (and in f16), so the MMA yields X_g = 4 s_g 2^(sq + sk) exactly (13 significant
// bits, as above), and t_g = X_g * C_g with the per-tile constant
// C_g = 2^(ebq_g + ebk_g - 256) (eq = ebq_g + sq, ek = ebk_g + sk). That is one rounding
// of the same real product as the reference's (s_g * 2^(eq-127)) * 2^(ek-127), whose
// first multiply is exact for eq <= 244: bitwise the reference, with one multiply per
// group instead of two and no per-key scale loads. A tile outside the windows (or with
// C_g out of f32's range) takes the two-multiply epilogue; its query scale is then
// 2^(ebq_g - 129) per group, since the query operands stay scaled.

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
static_assert(H == 8 || H == 16 || H == 32 || H == 64, "H must be a power of two in 8..=64");
static_assert(G == 1 || G == 2 || G == 4, "D must be 32, 64 or 128");

// Paged keys (SPEC 10; DSA_PAGED=1, set by the host, a variant of its own): `k` is the
// pool, u8 [num_pages, P * bytes_per_token], and every kernel takes two more arguments
// (LG_PAGED_PARAMS): the page table (i32, row b holds request b's pages) and log2(P).
// row_ks is then the row's request's first page-table entry (b * max_pages), and key j
// of the request sits at slot j % P of page page_table[ks + j / P] (paged_key); k_scale8
// and k_scale32 are unused. The host ensures P * bytes_per_token % 16 == 0 (the 16-byte
// key loads) and that every entry a row reads is a page of the pool. A tile's keys
// j0 .. j0 + 63 (j0 a multiple of 64) share one entry when P >= 64: its lanes' lookups
// of the table are one broadcast load.
#ifndef DSA_PAGED
#define DSA_PAGED 0
#endif
#if DSA_PAGED
#define LG_PAGED_PARAMS , const int *__restrict__ page_table, const u32 page_log2
// The same two, passed on and taken by the device functions that load keys.
#define PG_PASS , page_table, page_log2
#define PG_DECL , const int *__restrict__ page_table, const u32 page_log2
// Bytes of one token's codes and of its scale (SPEC 10's page layout).
#define PG_CODE_BYTES (KF == 1 ? D / 2 : D)
#define PG_SCALE_BYTES (KF == 1 ? G : 4)
struct PagedKey {
  const u8 *code;   // PG_CODE_BYTES codes
  const u8 *scale;  // E4M3: the f32 scale; E2M1: the G UE8M0 bytes
};
// The page-table entry of key j's page, for the request whose row starts at entry ks.
__device__ __forceinline__ int paged_entry(const int *page_table, const u32 ks, const u32 j,
                                           const u32 page_log2) {
  return __ldg(page_table + (u64)ks + (j >> page_log2));
}
// Key j of the request whose page-table row starts at entry ks.
__device__ __forceinline__ PagedKey paged_key(const u8 *pool, const int *page_table, const u32 ks,
                                              const u32 j, const u32 page_log2) {
  const u32 page = (u32)paged_entry(page_table, ks, j, page_log2);
  const u32 slot = j & ((1u << page_log2) - 1u);
  const u8 *base = pool + (u64)page * ((u64)(PG_CODE_BYTES + PG_SCALE_BYTES) << page_log2);
  return {base + (u64)slot * PG_CODE_BYTES,
          base + ((u64)PG_CODE_BYTES << page_log2) + (u64)slot * PG_SCALE_BYTES};
}
#else
#define LG_PAGED_PARAMS
#define PG_PASS
#define PG_DECL
#endif

// Scale folding for the exact class (see above); 0 forces the two-multiply epilogue
// everywhere (the fallback's test hook).
#ifndef SCALE_FOLD
#define SCALE_FOLD 1
#endif

// ==== path counters ====

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
// mqa_logits_wgi8's key tiles, counted once per block and tile: on the int8 path, and
// on mqa_logits_wgr's tile (the guard rejected the block's queries or the tile's keys).
#define LG_PATH_I8 4
#define LG_PATH_I8_FALLBACK 5
#define LG_PATHS 6
__device__ __forceinline__ void count_fold_paths(u32 *paths, const bool fold_q,
                                                 const bool two_mul) {
  if (paths == nullptr) return;
  const u32 t = __popc(__ballot_sync(0xFFFFFFFFu, two_mul)), o = 32u - t;
  if ((threadIdx.x & 31) == 0) {
    if (o) atomicAdd(&paths[LG_PATH_ONE], o);
    if (t) atomicAdd(&paths[LG_PATH_TWO], t);
  }
  if (threadIdx.x == 0) atomicAdd(&paths[fold_q ? LG_PATH_QFOLD : LG_PATH_QPLAIN], 1u);
}

// ==== SPEC 4's sums ====

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

// term_h = w_h * relu(a_h) and SPEC 4's pairwise head sum over a warpgroup's tile of
// two rows (sw[0], sw[1]) x 8 NTL heads, a[i] for i = 4j + 2kk + e (row j / NTL, head
// 8 (j % NTL) + 2 tig + e; key 16 warp + gid + 8 kk): heads (2 tig, +1) in the thread
// (head_quad), lane offset 1 (even lanes keep key gid, odd gid + 8), lane offset 2 (lanes
// with tig bit 1 keep row 1), then the NTL n-tiles pairwise in the thread. Used by
// mqa_logits_wgr, and by mqa_logits_w16 for rows whose weights could overflow.
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

// ==== exact-class scale folding ====

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

// ==== wgmma kernels: operand layout and output ====

// wgmma operands in shared memory (no swizzle, K-major canonical form): byte offset of
// 16-byte chunk kc of row m in a wgmma operand of `rows` rows.
__device__ __forceinline__ u32 wg_off(u32 m, u32 kc, u32 rows) {
  return kc * (rows / 8) * 128 + (m / 8) * 128 + (m % 8) * 16;
}

// A lane's output row r of the group, read once per block: where the row's logits start
// and how many keys it sees (0 when the group has no row r).
struct RowOut {
  float *out;
  u32 n;
};
__device__ __forceinline__ RowOut row_out(float *__restrict__ logits, const u64 *row_off,
                                          const u32 *row_n, const uint4 grp, const u32 r) {
  if (r >= grp.y) return {logits, 0u};
  const u32 row = grp.x + r;
  return {logits + row_off[row], row_n[row]};
}
// A logit as stored: a NaN as the contract's 0xFFC00000.
__device__ __forceinline__ float stored_logit(float logit) {
  if (logit != logit) logit = __uint_as_float(0xFFC00000u);
  return logit;
}
// Stores a wgmma kernel's logit of the lane's row o (row_out) and key j = jg (+ 8 on
// odd lanes, after the head sum) if the row sees it, a NaN as the contract's 0xFFC00000.
__device__ __forceinline__ void store_row_logit(const RowOut o, const u32 jg, const bool odd,
                                                float logit) {
  logit = stored_logit(logit);
  const u32 j = jg + (odd ? 8 : 0);
  if (j < o.n) o.out[j] = logit;
}
// store_row_logit where `valid` holds, as one predicated store (no branch: a caller with
// wgmma in flight keeps them asynchronous).
__device__ __forceinline__ void store_row_logit_if(const bool valid, const RowOut o, const u32 jg,
                                                   const bool odd, const float logit) {
  const u32 j = jg + (odd ? 8 : 0);
  st_global_f32_if(valid && j < o.n, o.out + (j < o.n ? j : 0), stored_logit(logit));
}
// store_row_logit of row r of the group (if the group has it), its row read here. Kept
// apart from store_row_logit on purpose: the default-mode kernels w16 and wgr were
// measured with this form, and routing it through row_out changes their code (wgi8 keeps
// its rows' row_out in shared memory).
__device__ __forceinline__ void store_logit(float *__restrict__ logits, const u64 *row_off,
                                            const u32 *row_n, const uint4 grp, const u32 r,
                                            const u32 jg, const bool odd, float logit) {
  logit = stored_logit(logit);
  if (r < grp.y) {
    const u32 row = grp.x + r;
    const u32 j = jg + (odd ? 8 : 0);
    if (j < row_n[row]) logits[row_off[row] + j] = logit;
  }
}
