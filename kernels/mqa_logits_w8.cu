// mqa_logits_w8: SPEC 4's logits of E4M3 x E4M3 with H = 64 on fp8 wgmma (W8=1, not the
// default: see Accuracy). Compiled after common.cuh, logits_common.cuh and
// logits_e4m3_h64.cuh (the tile).
//
// mqa_logits_w16's block and tile, with the operands left in E4M3: D / 32 e4m3 k32
// steps per 64-key tile instead of D / 16 f16 k16 ones (half the tensor steps and half
// the shared-memory bytes of B per tile, no cvt of the keys), the keys' bytes straight
// from global memory into the A fragments (the mma.sync m16n8k32 A layout of each
// warp's 16 keys: a0/a1 dims 4 tig .. + 3 of keys gid / gid + 8, a2/a3 the same at
// + 16). Of a thread's words of a key row (D / 4 contiguous bytes), word 2 s is
// k = 4 tig + 0..3 of k32 step s, word 2 s + 1 is k = 16 + 4 tig + 0..3; B uses the same
// order: word 2 s of column n's thread tg -> bytes 4 tg of chunk 2 s, word 2 s + 1 ->
// bytes 4 tg of chunk 2 s + 1.
//
// Accuracy: fp8 wgmma adds products with about 13 bits kept, aligned to the largest
// exponent-field sum of the step (cuda::FP8_WGMMA_TOLERANCE_LOG2 has what the H200
// showed). W8_SPLIT=1 (the default form) starts a fresh accumulator for every k32 step
// and adds the steps in f32 on the CUDA cores (no step cut to the unit of a running
// sum: the fp8 recipe of promoting partial sums), per row as m64n64k32; W8_SPLIT=0
// chains the D / 32 steps in the tensor core's accumulator. Neither meets SPEC 4's
// 2^-8 M when a subnormal operand is in a step's product of largest exponent fields,
// so this kernel is not the default; the fast precision mode is to use it.

// ==== configuration ====

// k32 steps per tile.
#define W8_S (D / 32)
// A fresh accumulator per k32 step, added in f32 (1), or the steps chained in the
// tensor core's accumulator (0).
#ifndef W8_SPLIT
#define W8_SPLIT 1
#endif
// Blocks per SM the registers must allow: at D = 128 the split form takes 127 registers
// with one k32 job in flight (two in flight took 161, 3 blocks, and ran slower), the
// chained form 123.
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

  for (int t = tid; t < H64_ROWS * H; t += H64_THREADS)
    sw[t / H][t % H] = w[(u64)row_of(t / H) * H + t % H];
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
  __syncthreads();

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

#if W8_SPLIT
    // Jobs i = 0 .. 2 W8_S - 1: row r = i / W8_S, k32 step s = i % W8_S (row r's columns
    // start 8 core matrices, 8 * 128 bytes, into each chunk), each an m64n64k32 from a
    // zero accumulator into the temporary t, one at a time; the CUDA cores add each into
    // the row's sums. A row's sums, once whole, go through the lane's part of the head
    // sum (tol_lane_heads) at once, so only one row's 32 sums are live.
    constexpr int jobs = 2 * W8_S;
    float t[32], acc[32], p[2][2];
    auto issue = [&](int i) {
      const int r = i / W8_S, s = i % W8_S;
      wgmma_fence();
      wgmma_m64n64k32_e4m3_rs(t, a[s], wgmma_desc(sB + 2 * s * lbo + r * 8 * 128, lbo, 128));
      wgmma_commit();
    };
    issue(0);
#pragma unroll
    for (int i = 0; i < jobs; ++i) {
      const int r = i / W8_S, s = i % W8_S;
      wgmma_wait<0>();
      fence_regs(t);
#pragma unroll
      for (int e = 0; e < 32; ++e) acc[e] = s == 0 ? t[e] : __fadd_rn(acc[e], t[e]);
      if (i + 1 < jobs) issue(i + 1);
      if (s == W8_S - 1) tol_lane_heads(acc, sw[r], tig, p[r][0], p[r][1]);
    }
    // The next tile's keys, loaded while the rest of the epilogue runs (every MMA of
    // this tile, whose A fragments they replace, has completed).
    if (c + gridDim.x < nchunks) prefetch(c + gridDim.x);
    const float hsum = tol_quad_sum(p[0][0], p[0][1], p[1][0], p[1][1], odd, hi);
#else
    if (c + gridDim.x < nchunks) prefetch(c + gridDim.x);
    float acc[64];
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < W8_S; ++s)
      wgmma_m64n128k32_e4m3_rs(acc, a[s], wgmma_desc(sB + 2 * s * lbo, lbo, 128), s > 0 ? 1u : 0u);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(acc);
    float p[2][2];
    tol_lane_heads(&acc[0], sw[0], tig, p[0][0], p[0][1]);
    tol_lane_heads(&acc[32], sw[1], tig, p[1][0], p[1][1]);
    const float hsum = tol_quad_sum(p[0][0], p[0][1], p[1][0], p[1][1], odd, hi);
#endif
    store_logit(logits, row_off, row_n, grp, hi ? 1u : 0u, j0 + 16 * warp + gid, odd,
                __fmul_rn(hsum, kscale));
  }
}
