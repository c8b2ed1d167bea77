// mqa_logits_wgr: SPEC 4's logits of the exact class (E2M1 x E2M1) for H = 32 and
// D >= 64 on fp8 wgmma, the keys in registers. Compiled after common.cuh,
// logits_common.cuh and logits_wgr.cuh (its tile), for those variants only.
//
// One m64n64k32 e4m3 wgmma per group g gives X_g for the tile (fresh accumulator: no
// chained groups): A, the keys, doubled E2M1 values, go from global memory straight
// into each warp's A fragments (fp8 wgmma takes A from registers), so the key loop has
// no shared memory and no barrier; B, the block's two query rows (doubled, times 2^s
// when the queries fold), is staged in shared memory once. Every product is an integer
// times 2^sq and every partial sum below 2^13 of that unit, so X_g is exact even from
// an accumulator that keeps only 13 bits per addition, which is what the bitwise tests
// hold it to. Dims are permuted as in mqa_logits_w16: in group g, thread tig of a quad
// takes dims 32 g + 8 tig + e (one u32 of 8 codes) as k = 4 tig + e (e < 4) and
// k = 12 + 4 tig + e (e >= 4) of the group's k32 step, and B is staged in the same
// order. Keys are not folded into the operands: where the queries fold, each group
// takes one multiply by the key's own power of two (the kernel says why that is
// bitwise), which costs less than a per-tile key window and a shifted decode in the
// key loop. The epilogue is mqa_logits's head sum, with the two rows in the place of
// its two m-tiles.

// ==== kernel ====

// block: rows grp.x + [0, 2) x 32 heads x keys 64 c + [0, 64) -> logits[row, key]
// (grp = groups[group0 + blockIdx.y], one warpgroup; c = blockIdx.x, + gridDim.x, ...)
extern "C" __global__ void __launch_bounds__(WGR_THREADS, WGR_MIN_BLOCKS) mqa_logits_wgr(
    const u8 *__restrict__ q, const u8 *__restrict__ q_scale, const u8 *__restrict__ k,
    const u8 *__restrict__ k_scale8, const float *__restrict__ k_scale32,
    const float *__restrict__ w, const u32 *__restrict__ row_n, const u32 *__restrict__ row_ks,
    const u64 *__restrict__ row_off, const uint4 *__restrict__ groups, u32 group0,
    float *__restrict__ logits, u32 *__restrict__ paths LG_PAGED_PARAMS) {
  __shared__ __align__(128) u8 sB[WGR_N * D];
  __shared__ __align__(8) float sqs[WGR_ROWS][G * H];
  __shared__ __align__(8) float sw[WGR_ROWS][H];
  __shared__ u32 stab[15][2];
  __shared__ u32 swq[2][WGR_THREADS / 32];

  const uint4 grp = groups[group0 + blockIdx.y];
  const u32 nchunks = (grp.z + WGR_KEYS - 1) / WGR_KEYS;
  if (blockIdx.x >= nchunks) return;
  const u32 ks = row_ks[grp.x];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gid = lane >> 2, tig = lane & 3;
  const bool odd = (tig & 1) != 0, hi = (tig & 2) != 0;
  auto row_of = [&](u32 r) { return grp.x + min(r, grp.y - 1); };

  int qbase[G];
  const bool fold_q =
      wgr_prologue(q_scale, w, row_of, sw, sqs, stab, swq[0], swq[1], qbase, tid, lane, warp);
  // A block whose folded query bases all lie in [107, 129] skips the per-key check that
  // C is an f32: it is, for every scale byte 0..254 (the one-multiply form below).
  bool qsafe = fold_q;
#pragma unroll
  for (int g = 0; g < G; ++g) qsafe = qsafe && qbase[g] >= 107 && qbase[g] <= 129;
  wgr_stage_queries(q, q_scale, row_of, fold_q, qbase, stab, sB, tid);
  fence_proxy_async();
  __syncthreads();

  u32 raw[2][G], rsc[2];
  bool none[2];
  const bool sc_word = (G == 4 || G == 2) &&
                       (reinterpret_cast<size_t>(k_scale8) & (size_t)(G - 1)) == 0;
  wgr_prefetch(raw, rsc, none, k, k_scale8, ks, grp.z, blockIdx.x, sc_word, warp, gid, tig PG_PASS);
  bool two_mul = false;  // some tile ran the two multiplies
  for (u32 c = blockIdx.x; c < nchunks; c += gridDim.x) {
    const u32 j0 = c * WGR_KEYS;
    const float logit =
        wgr_tile(raw, rsc, sB, fold_q, qsafe, sqs, sw, stab, two_mul, tig, odd, hi, [&] {
          if (c + gridDim.x < nchunks)
            wgr_prefetch(raw, rsc, none, k, k_scale8, ks, grp.z, c + gridDim.x, sc_word, warp, gid, tig PG_PASS);
        });
    store_logit(logits, row_off, row_n, grp, hi ? 1u : 0u, j0 + 16 * warp + gid, odd, logit);
  }
  count_fold_paths(paths, fold_q, two_mul);
}
