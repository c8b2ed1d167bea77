// mqa_logits_w8: SPEC 4's logits of E4M3 x E4M3 with H = 64 on fp8 wgmma: the fast
// precision mode (cuda::Precision::Fast, never the default: see Accuracy). Compiled
// after common.cuh, logits_common.cuh and logits_e4m3_h64.cuh (the tile).
//
// mqa_logits_w16's block and tile, with the operands left in E4M3: D / 32 e4m3 k32
// steps per 64-key tile instead of D / 16 f16 k16 ones (half the tensor steps and half
// the shared-memory bytes of B per tile, no cvt of the keys). Two forms of the keys:
// - D = 128 (W8_TMA, the default there): by TMA into shared memory, A from there (see
//   W8_TMA below); k32 step s holds dims 32 s .. 32 s + 31.
// - D = 32 and 64 (and W8_TMA=0): the keys' bytes straight from global memory into the
//   A fragments (the mma.sync m16n8k32 A layout of each warp's 16 keys: a0/a1 dims
//   4 tig .. + 3 of keys gid / gid + 8, a2/a3 the same at + 16). Of a thread's words of a
//   key row (D / 4 contiguous bytes), word 2 s is k = 4 tig + 0..3 of k32 step s, word
//   2 s + 1 is k = 16 + 4 tig + 0..3; B uses the same order: word 2 s of column n's
//   thread tg -> bytes 4 tg of chunk 2 s, word 2 s + 1 -> bytes 4 tg of chunk 2 s + 1.
//   So k32 step s holds dims (D / 4) t + 8 s + e.
// cuda::fp8_wgmma_step names the steps' dims of the form the host compiles.
//
// Accuracy: the D / 32 steps of a head are chained in the tensor core's accumulator,
// as DeepGEMM's kernel does. fp8 wgmma adds a step's products with about 13 bits kept,
// aligned to the largest exponent-field sum of the step, and a chained running sum
// joins that alignment (docs/numerics.md, section 4): the kernel meets SPEC 4's
// fast-mode bound (cuda::fast_logit_bound), not 2^-8 M.

// ==== configuration ====

// k32 steps per tile.
#define W8_S (D / 32)
// Blocks per SM the registers must allow (D = 128 with W8_TMA: 125 registers with flat
// keys, 128 with paged ones).
#ifndef W8_MIN_BLOCKS
#define W8_MIN_BLOCKS 4
#endif
// W8_TMA = 1 (D = 128, the default): both MMA operands from shared memory, the keys by
// TMA. Thread 0 keeps the next W8_RING - 1 key tiles in flight as bulk tensor copies
// (one per tile, or one per page for pages of fewer than 64 keys) into a ring of tiles
// in wgmma's 128-byte-swizzled A layout, each completing on its `full` mbarrier; no key
// byte takes a register and no other thread issues a copy. A ring tile is free again
// when every thread has arrived on its `empty` mbarrier after its MMA of the tile, and
// thread 0 refills it only after it issued the current tile's MMA, so that no thread
// waits for another but at the MMA itself. The key rows land in their natural order, so
// k32 step s holds dims 32 s .. 32 s + 31 (SPEC 4's fast mode at D = 128). The host
// passes the key tensor map (cuda::launch::key_tensor_map) as the last parameter.
// 0 (a tuning define): the keys in registers (h64_keys), A from registers.
#ifndef W8_TMA
#define W8_TMA 1
#endif
#if D != 128
#undef W8_TMA
#define W8_TMA 0
#endif

// W8_LPT = 1 (the default): the launch's groups longest first (h64_group; v32-16k fast
// 1.5 % faster than launch order, both measured in one run: benches/RESULTS.md). 0 (a
// tuning define): the groups in launch order.
#ifndef W8_LPT
#define W8_LPT 1
#endif

// ==== keys by TMA (W8_TMA) ====

#if W8_TMA
#define W8_TMA_PARAM , const __grid_constant__ TmaDesc kmap
// Ring tiles: 2 (one tile in flight while one is computed) or 3 (the most the static
// shared memory holds beside the queries). Flat keys (prefill: the keys stay in L2) take
// 2, paged keys (decode: every tile comes from HBM once) 3, each the faster on its
// workloads with both sizes measured in one run (benches/RESULTS.md).
#ifndef W8_RING
#if DSA_PAGED
#define W8_RING 3
#else
#define W8_RING 2
#endif
#endif
static_assert(W8_RING >= 2 && W8_RING <= 3, "W8_RING: 2 or 3");
static_assert(W8_TMA == 1, "W8_TMA: 0 or 1");
// One ring tile: 64 key rows of 128 bytes, 1024-byte aligned (wgmma_desc_sw128).
#define W8_TILE_BYTES (H64_KEYS * D)

// Thread 0: issues tile c's key rows into `tile`, completing on `bar`. Flat keys: one
// box of 64 rows from row ks + 64 c (rows past the buffer read as zeros). Paged keys
// (the map's boxes are min(P, 64) slots of one page): pages of 64 or more, one box from
// the tile's page `page` (paged_entry, loaded ahead by the caller); smaller pages, one box
// per page that holds a key below nkeys (the other rows of the tile keep older bytes,
// which no stored logit reads).
__device__ __forceinline__ void w8_tma_issue(u8 *tile, u64 *bar, const TmaDesc *kmap, const u32 ks,
                                             const u32 nkeys, const u32 c, const int page PG_DECL) {
  const u32 j0 = c * H64_KEYS;
#if DSA_PAGED
  if (page_log2 >= 6) {
    mbar_arrive_expect_tx(bar, W8_TILE_BYTES);
    tma_load_3d(tile, kmap, bar, 0, (int)(j0 & ((1u << page_log2) - 1u)), page);
  } else {
    const u32 P = 1u << page_log2;
    const u32 boxes = min(H64_KEYS >> page_log2, (nkeys - j0 + P - 1) >> page_log2);
    mbar_arrive_expect_tx(bar, boxes * P * D);
    for (u32 b = 0; b < boxes; ++b)
      tma_load_3d(tile + b * P * D, kmap, bar, 0, 0,
                  paged_entry(page_table, ks, j0 + b * P, page_log2));
  }
#else
  (void)nkeys;
  (void)page;
  mbar_arrive_expect_tx(bar, W8_TILE_BYTES);
  tma_load_2d(tile, kmap, bar, 0, (int)(ks + j0));
#endif
}

// The scale of key j of the block's request (0 past nkeys).
__device__ __forceinline__ float w8_kscale(const u8 *k, const float *k_scale32, const u32 ks,
                                           const u32 nkeys, const u32 j PG_DECL) {
  return j < nkeys ? h64_kscale(k, k_scale32, ks, j PG_PASS) : 0.0f;
}
#else
#define W8_TMA_PARAM
#endif

// ==== kernel ====

// block: rows grp.x + [0, 2) x 64 heads x keys 64 c + [0, 64) -> logits[row, key]
// (grp = groups[group0 + blockIdx.y], one warpgroup; c = blockIdx.x, + gridDim.x, ...)
extern "C" __global__ void __launch_bounds__(H64_THREADS, W8_MIN_BLOCKS) mqa_logits_w8(
    const u8 *__restrict__ q, const u8 *__restrict__ q_scale, const u8 *__restrict__ k,
    const u8 *__restrict__ k_scale8, const float *__restrict__ k_scale32,
    const float *__restrict__ w, const u32 *__restrict__ row_n, const u32 *__restrict__ row_ks,
    const u64 *__restrict__ row_off, const uint4 *__restrict__ groups, u32 group0,
    float *__restrict__ logits, u32 *__restrict__ paths LG_PAGED_PARAMS W8_TMA_PARAM) {
#if W8_TMA
  __shared__ __align__(1024) u8 sK[W8_RING][W8_TILE_BYTES];
  __shared__ __align__(8) u64 full[W8_RING];
  __shared__ __align__(8) u64 empty[W8_RING];
#endif
  __shared__ __align__(128) u8 sB[H64_N * D];
  __shared__ __align__(8) float sw[H64_ROWS][H];

  const uint4 grp = h64_group(groups, group0, W8_LPT);
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
#if W8_TMA
    // The natural order: bytes 32 tg .. + 32 are the column's chunks 2 tg and 2 tg + 1.
    *reinterpret_cast<uint4 *>(&sB[wg_off(n, 2 * tg, H64_N)]) = make_uint4(x[0], x[1], x[2], x[3]);
    *reinterpret_cast<uint4 *>(&sB[wg_off(n, 2 * tg + 1, H64_N)]) = make_uint4(x[4], x[5], x[6], x[7]);
#else
#pragma unroll
    for (int s = 0; s < W8_S; ++s) {
      *reinterpret_cast<u32 *>(&sB[wg_off(n, 2 * s, H64_N) + 4 * tg]) = x[2 * s];
      *reinterpret_cast<u32 *>(&sB[wg_off(n, 2 * s + 1, H64_N) + 4 * tg]) = x[2 * s + 1];
    }
#endif
  }
#if W8_TMA
  if (tid == 0) {
#pragma unroll
    for (int i = 0; i < W8_RING; ++i) {
      mbar_init(&full[i], 1);
      mbar_init(&empty[i], H64_THREADS);
    }
    fence_mbar_init();
  }
#endif
  fence_proxy_async();
  const bool spec_order = __syncthreads_or(big_w) != 0;  // block-uniform
  constexpr u32 lbo = (H64_N / 8) * 128;  // chunk to chunk

#if W8_TMA
  // Ring tile i % W8_RING holds the block's i-th tile (c = blockIdx.x + i gridDim.x),
  // landed when full[i % W8_RING] completes its phase i / W8_RING, free again when
  // empty[i % W8_RING] completes the same phase. Thread 0 issues the first W8_RING - 1,
  // then one per tile once it has issued the tile's MMA; with paged keys of 64 or more
  // per page it loads the page-table entry of the tile it issues next a tile ahead. This
  // lane's key after the head sum is 16 warp + gid (+ 8 on odd lanes); its scale is
  // loaded a tile ahead.
  int page_next = 0;
#if DSA_PAGED
  const bool page_ahead = page_log2 >= 6;
  auto page_of = [&](u32 ci) {
    return (page_ahead && ci < nchunks) ? paged_entry(page_table, ks, ci * H64_KEYS, page_log2) : 0;
  };
#else
  auto page_of = [&](u32) { return 0; };
#endif
  if (tid == 0) {
#pragma unroll
    for (int i = 0; i < W8_RING - 1; ++i) {
      const u32 ci = blockIdx.x + i * gridDim.x;
      if (ci < nchunks)
        w8_tma_issue(sK[i], &full[i], &kmap, ks, grp.z, ci, page_of(ci) PG_PASS);
    }
    page_next = page_of(blockIdx.x + (W8_RING - 1) * gridDim.x);
  }
  const u32 jl = 16 * warp + gid + (odd ? 8 : 0);
  float ksc_next = w8_kscale(k, k_scale32, ks, grp.z, blockIdx.x * H64_KEYS + jl PG_PASS);
  // The queries' descriptor, stepped per k32 step (wgmma_desc_add).
  const u64 db0 = wgmma_desc(sB, lbo, 128);
  const RowOut out = row_out(logits, row_off, row_n, grp, hi ? 1u : 0u);
  float2 wr[2][8];
  h64_lane_weights(wr, sw, tig);
  u32 slot = 0, phase = 0;
  for (u32 c = blockIdx.x; c < nchunks; c += gridDim.x) {
    const u32 j0 = c * H64_KEYS;
    const float kscale = ksc_next;
    if (c + gridDim.x < nchunks)
      ksc_next = w8_kscale(k, k_scale32, ks, grp.z, j0 + gridDim.x * H64_KEYS + jl PG_PASS);
    mbar_wait(&full[slot], phase);
    float acc[64];
    wgmma_fence();
    // Step s's A descriptor: the ring tile's, 32 s bytes in. Every lane holds the same
    // slot; read from lane 0 it is warp-uniform to ptxas, which then keeps the
    // descriptors in the uniform datapath: the tile's MMA section issues 36 instructions
    // per thread, against 48 with them stepped from sK[0]'s in vector registers (v32-64k
    // fast 0.9 to 1.8 % faster, benches/RESULTS.md).
    const u64 da = wgmma_desc_sw128(sK[__shfl_sync(FULL_MASK, slot, 0)]);
#pragma unroll
    for (int s = 0; s < W8_S; ++s)
      wgmma_m64n128k32_e4m3_ss(acc, wgmma_desc_add(da, 32 * s), wgmma_desc_add(db0, 2 * s * lbo),
                               s > 0 ? 1u : 0u);
    wgmma_commit();
    // Thread 0 refills the previous tile's ring tile (the slot before this one, in the
    // phase that tile used) with the tile W8_RING - 1 ahead, once every thread is done
    // with the previous tile's MMA (the block's first tile has no previous one: its
    // slot W8_RING - 1 was never used).
    if (tid == 0) {
      const u32 cn = c + (W8_RING - 1) * gridDim.x;
      const u32 prev = slot == 0 ? W8_RING - 1 : slot - 1;
      if (cn < nchunks) {
        if (c != blockIdx.x) mbar_wait(&empty[prev], slot == 0 ? phase ^ 1u : phase);
        w8_tma_issue(sK[prev], &full[prev], &kmap, ks, grp.z, cn, page_next PG_PASS);
      }
      page_next = page_of(cn + gridDim.x);
    }
    wgmma_wait<0>();
    fence_regs(acc);
    mbar_arrive(&empty[slot]);
    if (++slot == W8_RING) {
      slot = 0;
      phase ^= 1u;
    }
    const float hsum = h64_head_sum(acc, h64_reg_weights(wr), sw, spec_order, tig, odd, hi);
    store_row_logit(out, j0 + 16 * warp + gid, odd, __fmul_rn(hsum, kscale));
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
    const float hsum = h64_head_sum(acc, h64_smem_weights(sw, tig), sw, spec_order, tig, odd, hi);
    store_logit(logits, row_off, row_n, grp, hi ? 1u : 0u, j0 + 16 * warp + gid, odd,
                __fmul_rn(hsum, kscale));
  }
#endif
}
