// logits_e4m3_h64.cuh: the tile that mqa_logits_w16 and mqa_logits_w8 share, E4M3 x E4M3
// with H = 64 on wgmma: one warpgroup per block, H64_ROWS = 2 rows of one request as the
// MMA's N = 128 columns (row r, head h at column 64 r + h), 64-key tiles as its M side,
// the tolerance class's head sum, then the key scale. Compiled after common.cuh and
// logits_common.cuh, before the kernel's file.
//
// In the register form (mqa_logits_w16, and mqa_logits_w8 at D = 32, 64; mqa_logits_w8
// at D = 128 takes its keys by TMA into shared memory instead, see there), A (keys)
// comes from registers, in the mma.sync A fragment layout of each warp's 16 keys: no
// shared memory and no barrier for keys. The dot product does not care in
// which order the dims are paired, so the fragments use a permuted dim order in which
// thread tig of a quad reads D / 4 contiguous bytes of each key (H64_WORDS words), and B
// (the queries, staged once per block) uses the same order; each kernel says how its
// MMA steps take the words.

// ==== configuration ====

static_assert(QF == 0 && KF == 0 && H == 64, "the E4M3 x E4M3 tile for H = 64");
// Rows per block: 2 rows x 64 heads fill the 128 columns of one MMA
// (kernels::LOGITS_W16_ROWS).
#define H64_ROWS 2
// MMA columns: row r, head h at column 64 r + h.
#define H64_N (H64_ROWS * H)
// Keys per tile: the MMA's 64 rows, 16 per warp (kernels::LOGITS_KEYS).
#define H64_KEYS 64
// Threads per block: one warpgroup, the unit of a wgmma (kernels::LOGITS_WG_THREADS).
#define H64_THREADS 128
// Words (4 bytes) of one key or query head row that a thread's fragments take.
#define H64_WORDS (D / 16)
static_assert(H64_N == 128, "one m64n128 tile per MMA step");

// ==== the tolerance class's head sum ====

// The head sum in the cheapest order the tolerance class's bound allows
// (cuda::TOLERANCE_LOG2's derivation): one fma per term in the thread, then two
// transposed shuffle steps, about 90 instructions per tile fewer than SPEC 4's order.
// This lane's 16 heads of row r (columns 8 nt + 2 tig + e of sums a[4 nt + 2 kk + e])
// summed in the thread, one fma per term, for its two keys kk = 0, 1; then tol_quad_sum
// adds the quad's four lanes. wv_of(nt) is the lane's weight pair of n-tile nt (heads
// 8 nt + 2 tig + 0, 1 of row r), from shared memory or registers.
template <typename W>
__device__ __forceinline__ void tol_lane_heads(const float *a, const W wv_of, float &p0, float &p1) {
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    const float2 wv = wv_of(nt);
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

// ==== the block's group ====

// This block's group of rows (at most H64_ROWS rows of one request: first row,
// rows, longest row's keys): groups[group0 + blockIdx.y], or with `longest_first` the
// launch's groups in reverse order, so that in a causal prefill tile (later rows see more
// keys) the longest blocks start first and the last wave holds the short ones. Which
// group a block takes changes nothing else.
__device__ __forceinline__ uint4 h64_group(const uint4 *__restrict__ groups, const u32 group0,
                                           const bool longest_first) {
  return groups[group0 + (longest_first ? gridDim.y - 1 - blockIdx.y : blockIdx.y)];
}

// ==== keys and queries ====

// The H64_WORDS words of one key (or query head) row this thread's fragments take: bytes
// (D / 4) tig .. + D / 4.
__device__ __forceinline__ void h64_load(u32 (&x)[H64_WORDS], const u8 *row, const int tig) {
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

// The scale of key j (< nkeys) of the request whose keys start at ks, for a kernel that
// loads it apart from the key's codes (h64_keys reads both through one page lookup).
__device__ __forceinline__ float h64_kscale(const u8 *k, const float *k_scale32, const u32 ks,
                                            const u32 j PG_DECL) {
#if DSA_PAGED
  (void)k_scale32;
  return *reinterpret_cast<const float *>(paged_key(k, page_table, ks, j, page_log2).scale);
#else
  (void)k;
  return k_scale32[ks + j];
#endif
}

// This thread's two keys of key tile c (16 warp + gid, + 8): their bytes (h64_load)
// and scales, zeros past the group's nkeys keys (paged keys: through the page table).
__device__ __forceinline__ void h64_keys(u32 (&raw)[2][H64_WORDS], float (&ksc)[2], const u8 *k,
                                         const float *k_scale32, const u32 ks, const u32 nkeys,
                                         const u32 c, const int warp, const int gid,
                                         const int tig PG_DECL) {
#pragma unroll
  for (int kk = 0; kk < 2; ++kk) {
    const u32 j = c * H64_KEYS + 16 * warp + gid + 8 * kk;
    if (j < nkeys) {
#if DSA_PAGED
      const PagedKey pk = paged_key(k, page_table, ks, j, page_log2);
      h64_load(raw[kk], pk.code, tig);
      ksc[kk] = *reinterpret_cast<const float *>(pk.scale);
#else
      h64_load(raw[kk], k + (u64)(ks + j) * D, tig);
      ksc[kk] = k_scale32[ks + j];
#endif
    } else {
#pragma unroll
      for (int s = 0; s < H64_WORDS; ++s) raw[kk][s] = 0u;
      ksc[kk] = 0.0f;
    }
  }
}

// The block's two rows of weights into sw, and whether the block sums its heads in
// SPEC 4's order: a row whose largest |w_h| reaches 2^96 may overflow a term or a partial
// sum of its head sum (|a_h| < D * 448^2 < 2^25, 64 terms; fp8 wgmma's accumulator cuts
// toward zero, so the same holds there). Where anything overflows, IEEE's inf and NaN
// depend on the order of the steps, so such a block sums its heads in SPEC 4's order
// (two_row_head_sum); below, no step of either order overflows, and the fma chain is
// within the tolerance class's bound. Returns this thread's part of that test: the
// caller ORs it over the block at its barrier (__syncthreads_or).
__device__ __forceinline__ bool h64_stage_weights(float (*sw)[H], const float *w, const uint4 grp,
                                                  const int tid) {
  bool big_w = false;
  for (int t = tid; t < H64_ROWS * H; t += H64_THREADS) {
    const float wt = w[(u64)(grp.x + min((u32)(t / H), grp.y - 1)) * H + t % H];
    sw[t / H][t % H] = wt;
    big_w = big_w || !(fabsf(wt) < 0x1p96f);
  }
  return big_w;
}

// The tolerance order's weights of this lane: wv(r, nt) = row r's heads 8 nt + 2 tig + 0, 1,
// read from shared memory at each use (h64_smem_weights) or held in registers across
// tiles (h64_lane_weights, then h64_reg_weights).
__device__ __forceinline__ auto h64_smem_weights(const float (*sw)[H], const int tig) {
  return [sw, tig](int r, int nt) { return *reinterpret_cast<const float2 *>(&sw[r][nt * 8 + 2 * tig]); };
}
__device__ __forceinline__ void h64_lane_weights(float2 (&wr)[2][8], const float (*sw)[H],
                                                 const int tig) {
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) wr[r][nt] = h64_smem_weights(sw, tig)(r, nt);
}
__device__ __forceinline__ auto h64_reg_weights(const float2 (&wr)[2][8]) {
  return [&wr](int r, int nt) { return wr[r][nt]; };
}

// acc[4j + 2kk + e]: key 16 warp + gid + 8 kk, column 8 j + 2 tig + e (row j / 8): the
// head sum over the eight n-tiles of each row, in SPEC 4's order when spec_order (the
// weights from sw), else in the tolerance order with the weights wv (h64_smem_weights or
// h64_reg_weights).
template <typename WV>
__device__ __forceinline__ float h64_head_sum(const float (&acc)[64], const WV wv,
                                              const float (*sw)[H], const bool spec_order,
                                              const int tig, const bool odd, const bool hi) {
  if (spec_order) return two_row_head_sum<8>(acc, sw, tig, odd, hi);
  float p[2][2];
  tol_lane_heads(&acc[0], [&](int nt) { return wv(0, nt); }, p[0][0], p[0][1]);
  tol_lane_heads(&acc[32], [&](int nt) { return wv(1, nt); }, p[1][0], p[1][1]);
  return tol_quad_sum(p[0][0], p[0][1], p[1][0], p[1][1], odd, hi);
}
