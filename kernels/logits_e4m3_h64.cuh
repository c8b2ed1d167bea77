// logits_e4m3_h64.cuh: the tile that mqa_logits_w16 and mqa_logits_w8 share, E4M3 x E4M3
// with H = 64 on wgmma: one warpgroup per block, H64_ROWS = 2 rows of one request as the
// MMA's N = 128 columns (row r, head h at column 64 r + h), 64-key tiles as its M side
// with the keys in registers, the tolerance class's head sum, then the key scale.
// Compiled after common.cuh and logits_common.cuh, before the kernel's file.
//
// A (keys) comes from registers, in the mma.sync A fragment layout of each warp's 16
// keys: no shared memory and no barrier for keys. The dot product does not care in
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
// adds the quad's four lanes.
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

// ==== the bulk key ring (H64_BULK) ====

// H64_BULK = N (1..=8; 0, the default, is h64_keys' one-tile-ahead prefetch into
// registers): a block's next N key tiles are in flight while it computes one, each
// copied whole into a stage of shared memory by the async proxy. Warp 0 issues a tile:
// its codes as one bulk copy per run of contiguous keys (flat keys: the tile; paged keys:
// the tile's part of each page, one page when P >= 64) and its scales (paged keys: the
// same runs of the page's scale area, bulk; flat keys: one 4-byte cp.async per key, as
// the scale array need not be 16-byte aligned there). The stage's mbarrier completes when
// all of them have landed. The block reads a stage into the registers h64_keys would
// fill (the same words, zeros and 0.0f past nkeys), meets at a barrier, and warp 0 then
// refills the stage with the tile N ahead. A used page-table entry is looked up one issue
// ahead, so that the issuing warp does not wait on it.
//
// The host guarantees what the copies need: 16-byte aligned key codes (and pool), and for
// paged keys P * (D + 4) % 16 == 0, so P >= 4 and every run of scales is a multiple of
// 16 bytes (a run's last scales rounded up to 4 keys stay within its page).
#ifndef H64_BULK
#define H64_BULK 0
#endif
#if H64_BULK < 0 || H64_BULK > 8
#error "H64_BULK must be 0 or 1..=8"
#endif
// Bytes of one stage: the tile's codes and its 64 scales.
#define H64_STAGE_BYTES (H64_KEYS * D + H64_KEYS * 4)
// Stages a kernel with `other` bytes of other static shared memory takes: H64_BULK, or
// the most that keep the block within the 48 KB of static shared memory (0: none fits,
// the register prefetch). At D = 128 (8.25 KB a stage): 3 for mqa_logits_w8, 1 for w16.
#define H64_BULK_FIT(other) ((48 * 1024 - (other)) / (H64_STAGE_BYTES + 8))
#define H64_BULK_DEPTH(other) (H64_BULK < H64_BULK_FIT(other) ? H64_BULK : H64_BULK_FIT(other))

#if H64_BULK
struct H64Stage {
  u8 code[H64_KEYS * D];  // key i of the tile at i * D
  float scale[H64_KEYS];
};
// Arrivals that complete a stage: warp 0's lane 0 (announcing the bulk bytes), and for
// flat keys each lane of warp 0 once its scale copies have landed.
#define H64_BULK_ARRIVALS (DSA_PAGED ? 1 : 33)

// Where the block's keys come from.
struct H64BulkSrc {
  const u8 *k;
  const float *k_scale32;
  u32 ks, nkeys, nchunks;
#if DSA_PAGED
  const int *page_table;
  u32 page_log2;
#endif
};

// The page-table entry of lane's run of tile c (0 where the lane has no run): keys
// c * 64 + lane * min(P, 64) onwards.
__device__ __forceinline__ u32 h64_bulk_page(const H64BulkSrc &a, const u32 c, const int lane) {
#if DSA_PAGED
  const u32 per = min(1u << a.page_log2, (u32)H64_KEYS);
  const u32 first = (u32)lane * per, j = c * H64_KEYS + first;
  if (c < a.nchunks && first < H64_KEYS && j < a.nkeys)
    return (u32)__ldg(a.page_table + (u64)a.ks + (j >> a.page_log2));
#endif
  return 0u;
}

// Warp 0 (every lane): tile c's copies into stage s, completing *bar. pg: this lane's
// h64_bulk_page of tile c.
__device__ __forceinline__ void h64_bulk_issue(H64Stage &s, u64 *bar, const H64BulkSrc &a,
                                               const u32 c, const int lane, const u32 pg) {
  const u32 j0 = c * H64_KEYS;
  const u32 n = min((u32)H64_KEYS, a.nkeys - j0);
#if DSA_PAGED
  const u32 per = min(1u << a.page_log2, (u32)H64_KEYS);
  const u32 first = (u32)lane * per;
  const u32 m = first < n ? min(per, n - first) : 0u;  // this lane's run of keys
  const u32 msc = (m + 3u) & ~3u;                       // its scales, whole 16-byte units
  const u32 total = __reduce_add_sync(FULL_MASK, m * D + msc * 4u);
  if (lane == 0) mbar_arrive_expect_tx(bar, total);
  __syncwarp();
  if (m) {
    const u32 slot = (j0 + first) & ((1u << a.page_log2) - 1u);
    const u8 *base = a.k + (u64)pg * ((u64)(D + 4) << a.page_log2);
    bulk_g2s(s.code + first * D, base + (u64)slot * D, m * D, bar);
    bulk_g2s(&s.scale[first], base + ((u64)D << a.page_log2) + (u64)slot * 4u, msc * 4u, bar);
  }
#else
  (void)pg;
  if (lane == 0) {
    mbar_arrive_expect_tx(bar, n * D);
    bulk_g2s(s.code, a.k + (u64)(a.ks + j0) * D, n * D, bar);
  }
  for (u32 t = (u32)lane; t < H64_KEYS; t += 32)
    cp_async4(&s.scale[t], a.k_scale32 + a.ks + j0 + (t < n ? t : 0u), t < n ? 4u : 0u);
  cp_async_mbar_arrive(bar);
#endif
}

// This thread's two keys of tile c from stage s: h64_keys' raw and ksc.
__device__ __forceinline__ void h64_bulk_read(u32 (&raw)[2][H64_WORDS], float (&ksc)[2],
                                              const H64Stage &s, const u32 nkeys, const u32 c,
                                              const int warp, const int gid, const int tig) {
#pragma unroll
  for (int kk = 0; kk < 2; ++kk) {
    const u32 i = 16 * warp + gid + 8 * kk;
    if (c * H64_KEYS + i < nkeys) {
#if G == 4
      // Odd keys read their second 16 bytes first: the 8 lanes of each phase of the two
      // loads then cover all 32 banks.
      const uint4 *p = reinterpret_cast<const uint4 *>(s.code + i * D + (D / 4) * tig);
      const int f = gid & 1;
      const uint4 u = p[f], v = p[f ^ 1];
      const uint4 lo = f ? v : u, hi = f ? u : v;
      raw[kk][0] = lo.x; raw[kk][1] = lo.y; raw[kk][2] = lo.z; raw[kk][3] = lo.w;
      raw[kk][4] = hi.x; raw[kk][5] = hi.y; raw[kk][6] = hi.z; raw[kk][7] = hi.w;
#else
      h64_load(raw[kk], s.code + i * D, tig);
#endif
      ksc[kk] = s.scale[i];
    } else {
#pragma unroll
      for (int w = 0; w < H64_WORDS; ++w) raw[kk][w] = 0u;
      ksc[kk] = 0.0f;
    }
  }
}

// The ring of N stages and its walk over the block's tiles c = blockIdx.x + i gridDim.x.
template <int N>
struct H64Bulk {
  H64Stage stage[N];
  u64 bar[N];
};

// Thread 0 initialises the barriers; after the block's barrier warp 0 issues the first N
// tiles and looks up the entry of the next issue (returned; 0 for other warps).
template <int N>
__device__ __forceinline__ u32 h64_bulk_start(H64Bulk<N> &r, const H64BulkSrc &a, const int tid) {
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < N; ++s) mbar_init(&r.bar[s], H64_BULK_ARRIVALS);
    mbar_init_fence();
  }
  __syncthreads();
  u32 pg = 0;
  if (tid < 32) {
#pragma unroll
    for (int s = 0; s < N; ++s) {
      const u32 c = blockIdx.x + s * gridDim.x;
      if (c < a.nchunks) h64_bulk_issue(r.stage[s], &r.bar[s], a, c, tid, h64_bulk_page(a, c, tid));
    }
    pg = h64_bulk_page(a, blockIdx.x + N * gridDim.x, tid);
  }
  return pg;
}

// Tile c's keys from stage st once it has landed; after the block's barrier warp 0
// refills the stage with tile c + N gridDim.x. st and par (the stage's phase parity) move
// on; pg is warp 0's entry for the next issue.
template <int N>
__device__ __forceinline__ void h64_bulk_next(u32 (&raw)[2][H64_WORDS], float (&ksc)[2],
                                              H64Bulk<N> &r, int &st, u32 &par, u32 &pg,
                                              const H64BulkSrc &a, const u32 c, const int tid) {
  const int warp = tid >> 5, lane = tid & 31;
  mbar_wait(&r.bar[st], par);
  h64_bulk_read(raw, ksc, r.stage[st], a.nkeys, c, warp, lane >> 2, lane & 3);
  __syncthreads();  // every thread has read stage st
  const u32 cn = c + N * gridDim.x;
  if (warp == 0 && cn < a.nchunks) {
    h64_bulk_issue(r.stage[st], &r.bar[st], a, cn, lane, pg);
    pg = h64_bulk_page(a, cn + gridDim.x, lane);
  }
  if (++st == N) {
    st = 0;
    par ^= 1u;
  }
}
#endif  // H64_BULK

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

// acc[4j + 2kk + e]: key 16 warp + gid + 8 kk, column 8 j + 2 tig + e (row j / 8): the
// head sum over the eight n-tiles of each row, in SPEC 4's order when spec_order.
__device__ __forceinline__ float h64_head_sum(const float (&acc)[64], const float (*sw)[H],
                                              const bool spec_order, const int tig, const bool odd,
                                              const bool hi) {
  if (spec_order) return two_row_head_sum<8>(acc, sw, tig, odd, hi);
  float p[2][2];
  tol_lane_heads(&acc[0], sw[0], tig, p[0][0], p[0][1]);
  tol_lane_heads(&acc[32], sw[1], tig, p[1][0], p[1][1]);
  return tol_quad_sum(p[0][0], p[0][1], p[1][0], p[1][1], odd, hi);
}
