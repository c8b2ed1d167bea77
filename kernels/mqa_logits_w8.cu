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
// W8_STAGES = N >= 2 (D = 128): the keys of the next N - 1 tiles in flight by cp.async
// into a ring of N shared-memory tiles (their rows' 16-byte chunks XOR-swizzled by the
// row, so that a quad's fragment reads do not share banks), the fragments read from
// there; 0: each thread's next tile in registers (h64_keys). Either way a thread's
// fragments hold the same words of the same keys, so the MMA steps are unchanged.
#ifndef W8_STAGES
#define W8_STAGES 0
#endif
#if D != 128
#undef W8_STAGES
#define W8_STAGES 0
#endif
// Blocks per SM the registers must allow (123 registers at D = 128).
#ifndef W8_MIN_BLOCKS
#define W8_MIN_BLOCKS 4
#endif

// ==== keys through shared memory (W8_STAGES) ====

#if W8_STAGES
// One ring slot: a tile's 64 key rows (chunk cc of row r at 16 (cc ^ (r & 7)) of the
// row), then their 64 f32 scales.
#define W8_TILE_BYTES (H64_KEYS * D)
#define W8_SLOT_BYTES (W8_TILE_BYTES + 4 * H64_KEYS)

// Issues tile c's keys and scales into slot (cp.async, one group); zeros past nkeys keys
// (the source then a valid address that is not read).
__device__ __forceinline__ void w8_issue(u8 *slot, const u8 *k, const float *k_scale32,
                                         const u32 ks, const u32 nkeys, const u32 c,
                                         const int tid PG_DECL) {
  const u32 j0 = c * H64_KEYS;
#pragma unroll
  for (int u = 0; u < W8_TILE_BYTES / 16 / H64_THREADS; ++u) {
    const int idx = tid + u * H64_THREADS, r = idx / (D / 16), cc = idx % (D / 16);
    const u32 j = j0 + r;
    const u8 *src = k;
    if (j < nkeys) {
#if DSA_PAGED
      src = paged_key(k, page_table, ks, j, page_log2).code + 16 * cc;
#else
      src = k + (u64)(ks + j) * D + 16 * cc;
#endif
    }
    cp_async16(slot + r * D + 16 * (cc ^ (r & 7)), src, j < nkeys ? 16u : 0u);
  }
  if (tid < H64_KEYS) {
    const u32 j = j0 + tid;
    const void *src = k;
    if (j < nkeys) {
#if DSA_PAGED
      src = paged_key(k, page_table, ks, j, page_log2).scale;
#else
      src = k_scale32 + ks + j;
#endif
    }
    cp_async4(slot + W8_TILE_BYTES + 4 * tid, src, j < nkeys ? 4u : 0u);
  }
  cp_async_commit();
}

// This thread's words of its two keys (h64_keys's raw) and their scales, from a slot.
__device__ __forceinline__ void w8_read(u32 (&raw)[2][H64_WORDS], float (&ksc)[2], const u8 *slot,
                                        const int warp, const int gid, const int tig) {
#pragma unroll
  for (int kk = 0; kk < 2; ++kk) {
    const int r = 16 * warp + gid + 8 * kk;  // r & 7 == gid
    const uint4 a = *reinterpret_cast<const uint4 *>(slot + r * D + 16 * ((2 * tig) ^ gid));
    const uint4 b = *reinterpret_cast<const uint4 *>(slot + r * D + 16 * ((2 * tig + 1) ^ gid));
    raw[kk][0] = a.x; raw[kk][1] = a.y; raw[kk][2] = a.z; raw[kk][3] = a.w;
    raw[kk][4] = b.x; raw[kk][5] = b.y; raw[kk][6] = b.z; raw[kk][7] = b.w;
    ksc[kk] = reinterpret_cast<const float *>(slot + W8_TILE_BYTES)[r];
  }
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
#pragma unroll
    for (int s = 0; s < W8_S; ++s) {
      *reinterpret_cast<u32 *>(&sB[wg_off(n, 2 * s, H64_N) + 4 * tg]) = x[2 * s];
      *reinterpret_cast<u32 *>(&sB[wg_off(n, 2 * s + 1, H64_N) + 4 * tg]) = x[2 * s + 1];
    }
  }
  fence_proxy_async();
  const bool spec_order = __syncthreads_or(big_w) != 0;  // block-uniform

  // This thread's keys in a tile: 16 warp + gid (kk = 0) and + 8 (kk = 1); the next
  // tile's bytes and scales are loaded while this one is computed.
  u32 raw[2][H64_WORDS];
  float ksc[2];
#if W8_STAGES
  __shared__ __align__(128) u8 sK[W8_STAGES][W8_SLOT_BYTES];
  // Slot i % W8_STAGES holds the block's i-th tile; one group per tile, empty ones past
  // the last, so that wait_group counts tiles.
#pragma unroll
  for (int i = 0; i < W8_STAGES - 1; ++i) {
    const u32 ci = blockIdx.x + i * gridDim.x;
    if (ci < nchunks) w8_issue(sK[i], k, k_scale32, ks, grp.z, ci, tid PG_PASS);
    else cp_async_commit();
  }
  u32 it = 0;
#else
  auto prefetch = [&](u32 c) { h64_keys(raw, ksc, k, k_scale32, ks, grp.z, c, warp, gid, tig PG_PASS); };
  prefetch(blockIdx.x);
#endif
  constexpr u32 lbo = (H64_N / 8) * 128;  // chunk to chunk
  for (u32 c = blockIdx.x; c < nchunks; c += gridDim.x) {
    const u32 j0 = c * H64_KEYS;
#if W8_STAGES
    // Tile it has landed for every thread; every thread has read tile it - 1's slot,
    // which tile it + W8_STAGES - 1 then takes.
    cp_async_wait<W8_STAGES - 2>();
    __syncthreads();
    w8_read(raw, ksc, sK[it % W8_STAGES], warp, gid, tig);
    {
      const u32 cn = c + (W8_STAGES - 1) * gridDim.x;
      if (cn < nchunks)
        w8_issue(sK[(it + W8_STAGES - 1) % W8_STAGES], k, k_scale32, ks, grp.z, cn, tid PG_PASS);
      else
        cp_async_commit();
    }
    ++it;
#endif
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

#if !W8_STAGES
    if (c + gridDim.x < nchunks) prefetch(c + gridDim.x);
#endif
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
}
