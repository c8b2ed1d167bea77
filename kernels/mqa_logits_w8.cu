// mqa_logits_w8: SPEC 4's logits of E4M3 x E4M3 with H = 64 on fp8 wgmma: the fast
// precision mode (cuda::Precision::Fast, never the default: see Accuracy). Compiled
// after common.cuh, logits_common.cuh and logits_e4m3_h64.cuh (the tile).
//
// mqa_logits_w16's block and tile, with the operands left in E4M3: D / 32 e4m3 k32
// steps per 64-key tile instead of D / 16 f16 k16 ones (half the tensor steps and half
// the shared-memory bytes of B per tile, no cvt of the keys), the keys' bytes straight
// from global memory into the A fragments (the mma.sync m16n8k32 A layout of each
// warp's 16 keys: a0/a1 dims 4 tig .. + 3 of keys gid / gid + 8, a2/a3 the same at
// + 16). Of a thread's words of a key row (D / 4 contiguous bytes), word 2 s is
// k = 4 tig + 0..3 of k32 step s, word 2 s + 1 is k = 16 + 4 tig + 0..3; B uses the same
// order: word 2 s of column n's thread tg -> bytes 4 tg of chunk 2 s, word 2 s + 1 ->
// bytes 4 tg of chunk 2 s + 1. So k32 step s holds dims (D / 4) t + 8 s + e
// (cuda::fp8_wgmma_step).
//
// Accuracy: the D / 32 steps of a head are chained in the tensor core's accumulator,
// as DeepGEMM's kernel does. fp8 wgmma adds a step's products with about 13 bits kept,
// aligned to the largest exponent-field sum of the step, and a chained running sum
// joins that alignment (docs/numerics.md, section 4): the kernel meets SPEC 4's
// fast-mode bound (cuda::fast_logit_bound), not 2^-8 M.

// ==== configuration ====

// k32 steps per tile.
#define W8_S (D / 32)
// Blocks per SM the registers must allow (123 registers at D = 128).
#ifndef W8_MIN_BLOCKS
#define W8_MIN_BLOCKS 4
#endif
// W8_SS = N in 2..=3 (D = 128): both MMA operands from shared memory. The keys of the
// next N - 1 tiles are in flight by cp.async into a ring of N tiles laid out as wgmma's
// 128-byte-swizzled A operand, so no key byte passes through registers; 0: the keys in
// registers (h64_keys), A from registers. Either way k32 step s holds the same dims.
#ifndef W8_SS
#define W8_SS 0
#endif
#if D != 128
#undef W8_SS
#define W8_SS 0
#endif
static_assert(W8_SS == 0 || (W8_SS >= 2 && W8_SS <= 3),
              "W8_SS: 2 or 3 ring tiles (the static shared memory holds 3)");

// ==== both operands from shared memory (W8_SS) ====

#if W8_SS
// One ring tile: 64 key rows of 128 bytes, 1024-byte aligned (wgmma_desc_sw128).
#define W8_TILE_BYTES (H64_KEYS * D)

// The operand order of W8_SS, the same step sets as the register form's: k32 step s
// holds dims 32 t + 8 s + e (t < 4, e < 8) at k = 8 t + e, so the 8 contiguous bytes
// 8 p of a key (or query) row go to step p % 4, k = 8 (p / 4): the row's 16-byte chunk
// 2 (p % 4) + p / 8, at byte 8 ((p / 4) & 1) of it.
__device__ __forceinline__ u32 w8_chunk(u32 p) { return 2 * (p & 3) + (p >> 3); }
__device__ __forceinline__ u32 w8_half(u32 p) { return 8 * ((p >> 2) & 1); }

// Issues tile c's key bytes into ring tile `tile` (cp.async of 8 bytes, one group): row
// r's piece p at chunk w8_chunk(p) ^ (r & 7) of the row (the 128-byte swizzle), zeros
// past nkeys keys (the source then a valid address that is not read).
__device__ __forceinline__ void w8_issue(u8 *tile, const u8 *k, const u32 ks, const u32 nkeys,
                                         const u32 c, const int tid PG_DECL) {
  const u32 j0 = c * H64_KEYS;
#pragma unroll
  for (int u = 0; u < W8_TILE_BYTES / 8 / H64_THREADS; ++u) {
    const u32 idx = tid + u * H64_THREADS, r = idx / (D / 8), p = idx % (D / 8);
    const u32 j = j0 + r;
    const u8 *src = k;
    if (j < nkeys) {
#if DSA_PAGED
      src = paged_key(k, page_table, ks, j, page_log2).code + 8 * p;
#else
      src = k + (u64)(ks + j) * D + 8 * p;
#endif
    }
    cp_async8(tile + r * D + 16 * (w8_chunk(p) ^ (r & 7)) + w8_half(p), src, j < nkeys ? 8u : 0u);
  }
  cp_async_commit();
}

// The scale of key j of the block's request (0 past nkeys).
__device__ __forceinline__ float w8_kscale(const u8 *k, const float *k_scale32, const u32 ks,
                                           const u32 nkeys, const u32 j PG_DECL) {
  if (j >= nkeys) return 0.0f;
#if DSA_PAGED
  return *reinterpret_cast<const float *>(paged_key(k, page_table, ks, j, page_log2).scale);
#else
  return k_scale32[ks + j];
#endif
}
#endif

// ==== kernel ====

// block: rows grp.x + [0, 2) x 64 heads x keys 64 c + [0, 64) -> logits[row, key]
// (grp = groups[group0 + blockIdx.y], one warpgroup; c = blockIdx.x, + gridDim.x, ...)
extern "C" __global__ void __launch_bounds__(H64_THREADS, W8_MIN_BLOCKS) mqa_logits_w8(
    const u8 *__restrict__ q, const u8 *__restrict__ q_scale, const u8 *__restrict__ k,
    const u8 *__restrict__ k_scale8, const float *__restrict__ k_scale32,
    const float *__restrict__ w, const u32 *__restrict__ row_n, const u32 *__restrict__ row_ks,
    const u64 *__restrict__ row_off, const uint4 *__restrict__ groups, u32 group0,
    float *__restrict__ logits, u32 *__restrict__ paths LG_PAGED_PARAMS) {
#if W8_SS
  __shared__ __align__(1024) u8 sK[W8_SS][W8_TILE_BYTES];
#endif
  __shared__ __align__(128) u8 sB[H64_N * D];
  __shared__ __align__(8) float sw[H64_ROWS][H];

  const uint4 grp = groups[group0 + blockIdx.y];
  const u32 nchunks = (grp.z + H64_KEYS - 1) / H64_KEYS;
  if (blockIdx.x >= nchunks) return;
  const u32 ks = row_ks[grp.x];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gid = lane >> 2, tig = lane & 3;
  const bool odd = (tig & 1) != 0, hi = (tig & 2) != 0;
  auto row_of = [&](u32 r) { return grp.x + min(r, grp.y - 1); };

  const bool big_w = h64_stage_weights(sw, w, grp, tid);
  for (int t = tid; t < H64_N * 4; t += H64_THREADS) {
    const int n = t / 4, tg = t % 4;
    u32 x[H64_WORDS];
    h64_load(x, q + ((u64)row_of(n / H) * H + n % H) * D, tg);
#if W8_SS
    // Bytes 32 tg + 8 s .. + 8 (words 2 s, 2 s + 1): piece p = 4 tg + s.
#pragma unroll
    for (int s = 0; s < W8_S; ++s) {
      const u32 p = 4 * tg + s;
      *reinterpret_cast<uint2 *>(&sB[wg_off(n, w8_chunk(p), H64_N) + w8_half(p)]) =
          make_uint2(x[2 * s], x[2 * s + 1]);
    }
#else
#pragma unroll
    for (int s = 0; s < W8_S; ++s) {
      *reinterpret_cast<u32 *>(&sB[wg_off(n, 2 * s, H64_N) + 4 * tg]) = x[2 * s];
      *reinterpret_cast<u32 *>(&sB[wg_off(n, 2 * s + 1, H64_N) + 4 * tg]) = x[2 * s + 1];
    }
#endif
  }
  fence_proxy_async();
  const bool spec_order = __syncthreads_or(big_w) != 0;  // block-uniform

  constexpr u32 lbo = (H64_N / 8) * 128;  // chunk to chunk
#if W8_SS
  // Ring tile i % W8_SS holds the block's i-th tile; one cp.async group per tile, empty
  // ones past the last, so that wait_group counts tiles. This lane's key after the head
  // sum is 16 warp + gid (+ 8 on odd lanes); its scale is loaded a tile ahead.
#pragma unroll
  for (int i = 0; i < W8_SS - 1; ++i) {
    const u32 ci = blockIdx.x + i * gridDim.x;
    if (ci < nchunks) w8_issue(sK[i], k, ks, grp.z, ci, tid PG_PASS);
    else cp_async_commit();
  }
  const u32 jl = 16 * warp + gid + (odd ? 8 : 0);
  float ksc_next = w8_kscale(k, k_scale32, ks, grp.z, blockIdx.x * H64_KEYS + jl PG_PASS);
  u32 it = 0;
  for (u32 c = blockIdx.x; c < nchunks; c += gridDim.x, ++it) {
    const u32 j0 = c * H64_KEYS;
    // Tile it has landed for every thread and is visible to the tensor cores; every
    // thread has waited on tile it - 1's MMA, so its ring tile takes tile it + W8_SS - 1.
    cp_async_wait<W8_SS - 2>();
    fence_proxy_async();
    __syncthreads();
    {
      const u32 cn = c + (W8_SS - 1) * gridDim.x;
      if (cn < nchunks) w8_issue(sK[(it + W8_SS - 1) % W8_SS], k, ks, grp.z, cn, tid PG_PASS);
      else cp_async_commit();
    }
    const float kscale = ksc_next;
    if (c + gridDim.x < nchunks)
      ksc_next = w8_kscale(k, k_scale32, ks, grp.z, j0 + gridDim.x * H64_KEYS + jl PG_PASS);
    const u8 *tile = sK[it % W8_SS];
    float acc[64];
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < W8_S; ++s)
      wgmma_m64n128k32_e4m3_ss(acc, wgmma_desc_sw128(tile + 32 * s),
                               wgmma_desc(sB + 2 * s * lbo, lbo, 128), s > 0 ? 1u : 0u);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(acc);
    const float hsum = h64_head_sum(acc, sw, spec_order, tig, odd, hi);
    store_logit(logits, row_off, row_n, grp, hi ? 1u : 0u, j0 + 16 * warp + gid, odd,
                __fmul_rn(hsum, kscale));
  }
#else
  // This thread's keys in a tile: 16 warp + gid (kk = 0) and + 8 (kk = 1); the next
  // tile's bytes and scales are loaded while this one is computed.
  u32 raw[2][H64_WORDS];
  float ksc[2];
  auto prefetch = [&](u32 c) { h64_keys(raw, ksc, k, k_scale32, ks, grp.z, c, warp, gid, tig PG_PASS); };
  prefetch(blockIdx.x);
  for (u32 c = blockIdx.x; c < nchunks; c += gridDim.x) {
    const u32 j0 = c * H64_KEYS;
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

    if (c + gridDim.x < nchunks) prefetch(c + gridDim.x);
    float acc[64];
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < W8_S; ++s)
      wgmma_m64n128k32_e4m3_rs(acc, a[s], wgmma_desc(sB + 2 * s * lbo, lbo, 128), s > 0 ? 1u : 0u);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(acc);
    const float hsum = h64_head_sum(acc, sw, spec_order, tig, odd, hi);
    store_logit(logits, row_off, row_n, grp, hi ? 1u : 0u, j0 + 16 * warp + gid, odd,
                __fmul_rn(hsum, kscale));
  }
#endif
}
