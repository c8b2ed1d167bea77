// logits_e4m3_h64.cuh: the tile that mqa_logits_w16 and mqa_logits_w8 share, E4M3 x E4M3
// with H = 64 on wgmma: one warpgroup per block, H64_ROWS = 2 rows of one request as the
// MMA's N = 128 columns (row r, head h at column 64 r + h), 64-key tiles as its M side
// with the keys in registers, the tolerance class's head sum, then the key scale.
// Compiled after common.cuh and logits_common.cuh, before the kernel's file.
//
// A (keys) comes from registers, in the mma.sync A fragment layout of each warp's 16
// keys: no shared memory (but for the opt-in key ring, H64_RING below) and no barrier
// for keys. The dot product does not care in which order the dims are paired, so the
// fragments use a permuted dim order in which thread tig of a quad reads D / 4
// contiguous bytes of each key (H64_WORDS words), and B (the queries, staged once per
// block) uses the same order; each kernel says how its MMA steps take the words.

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

// ==== the key ring (H64_RING) ====

// H64_RING = N (1..=6; 0, the default, is h64_keys' one-tile-ahead prefetch into
// registers): the thread's two keys of its next N tiles are in flight while it computes
// one, copied by cp.async into a ring of N stages in shared memory that is the thread's
// own. Stage s = i mod N holds the block's i-th tile c = blockIdx.x + i gridDim.x (what
// h64_keys would load for c: the same words, zeros and 0.0f past nkeys); once the thread
// has read it into raw / ksc, the stage takes the tile N ahead. The bytes in flight are
// then bounded by shared memory, not by registers (the prefetched tile holds
// 2 H64_WORDS + 2 of them through the MMA and the head sum).
//
// No barrier: a thread reads only the stage entries it copied itself. cp.async is a weak
// memory operation of the generic proxy, and the completion of cp.async.wait_group on a
// group makes that group's writes visible to the executing thread (PTX ISA,
// cp.async.wait_group); the copy that refills a stage comes after the thread's loads of
// it in program order. Each thread commits one group per tile of its sequence, empty past
// the last tile, so that wait_group N - 1 always completes the tile about to be read.
#ifndef H64_RING
#define H64_RING 0
#endif
#if H64_RING < 0 || H64_RING > 6
#error "H64_RING must be 0 or 1..=6"
#endif
// Bytes of one stage: each thread's two keys, D / 4 code bytes and an f32 scale each.
#define H64_RING_STAGE_BYTES (H64_THREADS * 2 * (D / 4 + 4))
// Stages a kernel with `other` bytes of other static shared memory takes: H64_RING, or
// the most that keep the block within the 48 KB of static shared memory a kernel may
// declare (0 if none fits: the register prefetch). At D = 128 (9 KB a stage) that is 3
// for mqa_logits_w8 and 1 for mqa_logits_w16 (32 KB of f16 B).
#define H64_RING_FIT(other) ((48 * 1024 - (other)) / H64_RING_STAGE_BYTES)
#define H64_RING_DEPTH(other) (H64_RING < H64_RING_FIT(other) ? H64_RING : H64_RING_FIT(other))

#if H64_RING
// A thread's D / 4 bytes of a key row as 16-byte chunks (D = 32: one 8-byte chunk; cp.async
// copies 4, 8 or 16 bytes).
#if G == 1
typedef uint2 H64Chunk;
#define H64_CHUNK_WORDS 2
#else
typedef uint4 H64Chunk;
#define H64_CHUNK_WORDS 4
#endif
#define H64_CHUNKS (H64_WORDS / H64_CHUNK_WORDS)

// The ring: [stage][kk][chunk][thread], so that a warp's copies and loads of one chunk
// are 32 consecutive chunks (no bank conflicts).
template <int N>
struct H64Ring {
  H64Chunk code[N][2][H64_CHUNKS][H64_THREADS];
  float scale[N][2][H64_THREADS];
};

// Where the thread's keys come from: the kernel's key arguments and the thread's place.
struct H64KeySrc {
  const u8 *k;
  const float *k_scale32;
  u32 ks, nkeys, nchunks;
  int warp, gid, tig, tid;
#if DSA_PAGED
  const int *page_table;
  u32 page_log2;
#endif
};

// The ring's loads, as volatile asms: cp_async* and cp_async_wait are volatile asms
// without a memory clobber, so the compiler does not know that they write the ring, and
// could move a plain load of it above the wait or below the next copy into the same
// stage; volatile asms keep their order.
__device__ __forceinline__ void h64_lds(u32 (&x)[4], const void *p) {
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(x[0]), "=r"(x[1]), "=r"(x[2]), "=r"(x[3])
               : "r"((u32)__cvta_generic_to_shared(p)));
}
__device__ __forceinline__ void h64_lds(u32 (&x)[2], const void *p) {
  asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];\n"
               : "=r"(x[0]), "=r"(x[1])
               : "r"((u32)__cvta_generic_to_shared(p)));
}
__device__ __forceinline__ float h64_lds_f32(const float *p) {
  float x;
  asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(x) : "r"((u32)__cvta_generic_to_shared(p)));
  return x;
}

// Issues the copies of the thread's two keys of tile c (< nchunks) into stage st:
// h64_keys' addresses, and past nkeys zero-size copies (zero fill) from the tile's first
// key, which exists.
template <int N>
__device__ __forceinline__ void h64_ring_issue(H64Ring<N> &ring, const int st, const H64KeySrc &a,
                                               const u32 c) {
  const u32 j0 = c * H64_KEYS;
#pragma unroll
  for (int kk = 0; kk < 2; ++kk) {
    const u32 j = j0 + 16 * a.warp + a.gid + 8 * kk;
    const bool in = j < a.nkeys;
    const u32 js = in ? j : j0;
#if DSA_PAGED
    const PagedKey pk = paged_key(a.k, a.page_table, a.ks, js, a.page_log2);
    const u8 *code = pk.code + (D / 4) * a.tig;
    const void *scale = pk.scale;
#else
    const u8 *code = a.k + (u64)(a.ks + js) * D + (D / 4) * a.tig;
    const void *scale = a.k_scale32 + a.ks + js;
#endif
#pragma unroll
    for (int ch = 0; ch < H64_CHUNKS; ++ch) {
#if G == 1
      cp_async8(&ring.code[st][kk][ch][a.tid], code, in ? 8u : 0u);
#else
      cp_async16(&ring.code[st][kk][ch][a.tid], code + 16 * ch, in ? 16u : 0u);
#endif
    }
    cp_async4(&ring.scale[st][kk][a.tid], scale, in ? 4u : 0u);
  }
}

// Stages 0 .. N - 1: the block's first N tiles c = blockIdx.x + s gridDim.x (an empty
// group for each past nchunks).
template <int N>
__device__ __forceinline__ void h64_ring_start(H64Ring<N> &ring, const H64KeySrc &a) {
#pragma unroll
  for (int s = 0; s < N; ++s) {
    const u32 c = blockIdx.x + s * gridDim.x;
    if (c < a.nchunks) h64_ring_issue(ring, s, a, c);
    cp_async_commit();
  }
}

// Tile c's two keys from stage st (h64_keys' raw and ksc); then the stage takes tile
// c + N gridDim.x, and st moves on to the next stage.
template <int N>
__device__ __forceinline__ void h64_ring_next(u32 (&raw)[2][H64_WORDS], float (&ksc)[2],
                                              H64Ring<N> &ring, int &st, const H64KeySrc &a,
                                              const u32 c) {
  cp_async_wait<N - 1>();  // tile c's group; the N - 1 newer ones may still be pending
#pragma unroll
  for (int kk = 0; kk < 2; ++kk) {
#pragma unroll
    for (int ch = 0; ch < H64_CHUNKS; ++ch) {
      u32 x[H64_CHUNK_WORDS];
      h64_lds(x, &ring.code[st][kk][ch][a.tid]);
#pragma unroll
      for (int e = 0; e < H64_CHUNK_WORDS; ++e) raw[kk][H64_CHUNK_WORDS * ch + e] = x[e];
    }
    ksc[kk] = h64_lds_f32(&ring.scale[st][kk][a.tid]);
  }
  const u32 cn = c + N * gridDim.x;
  if (cn < a.nchunks) h64_ring_issue(ring, st, a, cn);
  cp_async_commit();
  st = st == N - 1 ? 0 : st + 1;
}
#endif  // H64_RING

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
