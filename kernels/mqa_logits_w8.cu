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
  auto prefetch = [&](u32 c) { h64_keys(raw, ksc, k, k_scale32, ks, grp.z, c, warp, gid, tig PG_PASS); };
  prefetch(blockIdx.x);
  constexpr u32 lbo = (H64_N / 8) * 128;  // chunk to chunk
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
}
