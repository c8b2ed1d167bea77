// mqa_logits_w16: SPEC 4's logits of E4M3 x E4M3 with H = 64 on f16 wgmma (f32
// accumulation), the default for those variants. Compiled after common.cuh,
// logits_common.cuh and logits_e4m3_h64.cuh (the tile).
//
// Per tile, D / 16 chained m64n128k16 f16 wgmmas with f32 accumulation. Why f16: every
// E4M3 value is exact in f16 and every product exact in f32, so the error is that of f32
// accumulation, as on the mma.sync path (the stated 2^-16 M bound, cuda::TOLERANCE_LOG2);
// fp8 wgmma keeps about 13 bits per addition (a probe on the H200), which no bound near
// 2^-16 M survives, and on subnormal operands not even SPEC 4's 2^-8 M (mqa_logits_w8).
// A thread's word s of a key row holds dims (D/4) tig + 4 s + e, e = 0..3: k = 2 tig + e
// (e < 2) and 2 tig + 6 + e (e >= 2) of k16 step s. E4M3 -> f16 by cvt (exact).

// ==== configuration ====

// k16 steps per tile: one per word of a thread's key row.
#define W16_S H64_WORDS
// Blocks per SM the registers must allow: 4 (128 registers, no spills) ran faster than
// 3 (134 registers).
#ifndef W16_MIN_BLOCKS
#define W16_MIN_BLOCKS 4
#endif
// W16_LPT = 1 (the default): the launch's groups longest first (h64_group; v32-16k's
// logits 1.3 to 2.6 % faster than in launch order, both measured in one run:
// benches/RESULTS.md). 0 (a tuning define): the groups in launch order.
#ifndef W16_LPT
#define W16_LPT 1
#endif

// ==== kernel ====

// block: rows grp.x + [0, 2) x 64 heads x keys 64 c + [0, 64) -> logits[row, key]
// (grp = groups[group0 + blockIdx.y], one warpgroup; c = blockIdx.x, + gridDim.x, ...)
extern "C" __global__ void __launch_bounds__(H64_THREADS, W16_MIN_BLOCKS) mqa_logits_w16(
    const u8 *__restrict__ q, const u8 *__restrict__ q_scale, const u8 *__restrict__ k,
    const u8 *__restrict__ k_scale8, const float *__restrict__ k_scale32,
    const float *__restrict__ w, const u32 *__restrict__ row_n, const u32 *__restrict__ row_ks,
    const u64 *__restrict__ row_off, const uint4 *__restrict__ groups, u32 group0,
    float *__restrict__ logits, u32 *__restrict__ paths LG_PAGED_PARAMS) {
  __shared__ __align__(128) u8 sB[H64_N * D * 2];
  __shared__ __align__(8) float sw[H64_ROWS][H];

  const uint4 grp = h64_group(groups, group0, W16_LPT);
  const u32 nchunks = (grp.z + H64_KEYS - 1) / H64_KEYS;
  if (blockIdx.x >= nchunks) return;
  const u32 ks = row_ks[grp.x];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gid = lane >> 2, tig = lane & 3;
  const bool odd = (tig & 1) != 0, hi = (tig & 2) != 0;
  auto row_of = [&](u32 r) { return grp.x + min(r, grp.y - 1); };

  const bool big_w = h64_stage_weights(sw, w, grp, tid);
  // B: column n (row n / H, head n % H), k16 step s: chunk 2s holds k = 0..7 (e = 0, 1 of
  // the four quad threads' words), chunk 2s + 1 holds k = 8..15 (e = 2, 3).
  for (int t = tid; t < H64_N * 4; t += H64_THREADS) {
    const int n = t / 4, tg = t % 4;
    u32 x[H64_WORDS];
    h64_load(x, q + ((u64)row_of(n / H) * H + n % H) * D, tg);
#pragma unroll
    for (int s = 0; s < W16_S; ++s) {
      *reinterpret_cast<u32 *>(&sB[wg_off(n, 2 * s, H64_N) + 4 * tg]) = e4m3x2_f16x2(x[s]);
      *reinterpret_cast<u32 *>(&sB[wg_off(n, 2 * s + 1, H64_N) + 4 * tg]) =
          e4m3x2_f16x2(x[s] >> 16);
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
    u32 a[W16_S][4];
#pragma unroll
    for (int s = 0; s < W16_S; ++s) {
      a[s][0] = e4m3x2_f16x2(raw[0][s]);
      a[s][1] = e4m3x2_f16x2(raw[1][s]);
      a[s][2] = e4m3x2_f16x2(raw[0][s] >> 16);
      a[s][3] = e4m3x2_f16x2(raw[1][s] >> 16);
    }
    const float kscale = odd ? ksc[1] : ksc[0];  // this lane's key after the head sum
    if (c + gridDim.x < nchunks) prefetch(c + gridDim.x);

    float acc[64];
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < W16_S; ++s)
      wgmma_m64n128k16_f16_rs(acc, a[s], wgmma_desc(sB + 2 * s * lbo, lbo, 128), s > 0 ? 1u : 0u);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(acc);

    // acc[4j + 2kk + e]: key 16 warp + gid + 8 kk, column 8 j + 2 tig + e (row j / 8);
    // the head sum over the eight n-tiles of each row, then the key scale.
    const float hsum = h64_head_sum(acc, h64_smem_weights(sw, tig), sw, spec_order, tig, odd, hi);
    store_logit(logits, row_off, row_n, grp, hi ? 1u : 0u, j0 + 16 * warp + gid, odd,
                __fmul_rn(hsum, kscale));
  }
}
