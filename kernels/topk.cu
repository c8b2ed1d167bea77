// topk: SPEC 5 selection and index assembly, and SPEC 6 kept blocks, on the device.
// block: one row -> its selected ids sorted ascending, -1 padded (raw, page or
//        published), from that row's scores in the tile buffer.
//
// Radix select on the order-preserving 32-bit key: four 8-bit digit passes, each a
// histogram of the candidates that match the digits found so far, give the exact K-th
// key T and how many of the keys equal to T are taken (the lowest j first: SPEC 5's
// total order). A last pass walks j in order and writes the selected ids in place with
// one block scan per chunk: output position = (keys > T before) + min(ties before, r).
// Key 0 marks "not a candidate" (a consumer row's keys outside its kept blocks); no
// score has key 0.

#define TK_THREADS 512
#define TK_ITEMS 8  // consecutive ids per thread in the ordered pass
static_assert(TK_THREADS % 32 == 0 && TK_THREADS <= 1024, "block size");
static_assert(TK_THREADS * TK_ITEMS <= 65535, "per-chunk counts are packed in 16 bits");

struct TopkRow {
  u32 n;        // scores in the row
  u32 k;        // entries to select
  u32 pinned;   // block mode: the pinned block's index (ranks first); else ~0u
};

// MODE 0: f32 logits (ranking key computed here), optional consumer bitmap.
// MODE 1: u32 block keys, the pinned block forced first.
template <int MODE>
__device__ __forceinline__ u32 load_key(const void *scores, u32 j, const u32 *bitmap,
                                        u32 block_size, u32 pinned) {
  if (MODE == 0) {
    if (bitmap) {
      const u32 c = j / block_size;
      if (!((bitmap[c >> 5] >> (c & 31)) & 1u)) return 0u;
    }
    return rank_key(reinterpret_cast<const float *>(scores)[j]);
  } else {
    return j == pinned ? 0xFFFFFFFFu : reinterpret_cast<const u32 *>(scores)[j];
  }
}

template <int MODE>
__device__ void topk_row(const void *scores, const u32 n, const u32 K, const u32 pinned,
                         const u32 *bitmap, const u32 block_size, i32 *out_ids,
                         const u32 out_cols, i32 *out_page, const u32 page_cols,
                         const i32 *k_slots, const u32 ks) {
  __shared__ u32 hist[256];
  __shared__ u32 scan[33];
  __shared__ u32 sel[3];  // prefix, remaining, total candidates
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  u32 prefix = 0, mask = 0, remaining = K;
  bool all = false;
  for (int pass = 0; pass < 4; ++pass) {
    const int shift = 24 - 8 * pass;
    for (int i = tid; i < 256; i += TK_THREADS) hist[i] = 0;
    __syncthreads();
    for (u32 j = tid; j < n; j += TK_THREADS) {
      const u32 key = load_key<MODE>(scores, j, bitmap, block_size, pinned);
      if (key != 0u && (key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
    }
    __syncthreads();
    if (warp == 0) {
      // Lane l owns digits 255-8l .. 248-8l (descending).
      u32 c[8], local = 0;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        c[i] = hist[255 - (lane * 8 + i)];
        local += c[i];
      }
      u32 incl = local;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const u32 y = __shfl_up_sync(FULL_MASK, incl, o);
        if (lane >= o) incl += y;
      }
      const u32 total = __shfl_sync(FULL_MASK, incl, 31);
      const u32 before = incl - local;
      if (pass == 0 && lane == 0) sel[2] = total;
      // The digit where the running count reaches `remaining`.
      const bool mine = before < remaining && incl >= remaining;
      if (mine) {
        u32 cum = before;
        for (int i = 0; i < 8; ++i) {
          if (cum + c[i] >= remaining) {
            sel[0] = prefix | ((u32)(255 - (lane * 8 + i)) << shift);
            sel[1] = remaining - cum;
            break;
          }
          cum += c[i];
        }
      }
    }
    __syncthreads();
    if (pass == 0 && sel[2] <= K) {
      all = true;  // m <= K: every candidate is selected, no score compared
      break;
    }
    prefix = sel[0];
    remaining = sel[1];
    mask |= 255u << shift;
    __syncthreads();
  }
  // Threshold T = prefix; `remaining` keys equal to T are taken, lowest j first.
  const u32 T = all ? 0u : prefix;
  const u32 take_eq = all ? 0u : remaining;

  u32 gt_before = 0, eq_before = 0;
  const u32 chunk = TK_THREADS * TK_ITEMS;
  for (u32 base = 0; base < n; base += chunk) {
    u32 keys[TK_ITEMS];
    u32 ngt = 0, neq = 0;
#pragma unroll
    for (int i = 0; i < TK_ITEMS; ++i) {
      const u32 j = base + tid * TK_ITEMS + i;
      keys[i] = j < n ? load_key<MODE>(scores, j, bitmap, block_size, pinned) : 0u;
      ngt += keys[i] > T;
      neq += (keys[i] == T && keys[i] != 0u);
    }
    u32 tot;
    const u32 ex = block_exclusive_scan((ngt << 16) | neq, scan, &tot);
    u32 g = gt_before + (ex >> 16), e = eq_before + (ex & 0xFFFFu);
#pragma unroll
    for (int i = 0; i < TK_ITEMS; ++i) {
      const u32 j = base + tid * TK_ITEMS + i;
      const bool is_gt = keys[i] > T;
      const bool is_eq = keys[i] == T && keys[i] != 0u;
      if (is_gt || (is_eq && e < take_eq)) {
        const u32 pos = g + min(e, take_eq);
        out_ids[pos] = (i32)j;
        if (out_page) out_page[pos] = k_slots ? k_slots[ks + j] : (i32)(ks + j);
      }
      g += is_gt;
      e += is_eq;
    }
    gt_before += tot >> 16;
    eq_before += tot & 0xFFFFu;
  }
  const u32 count = gt_before + min(eq_before, take_eq);
  for (u32 c = count + tid; c < out_cols; c += TK_THREADS) out_ids[c] = -1;
  if (out_page)
    for (u32 c = count + tid; c < page_cols; c += TK_THREADS) out_page[c] = -1;
}

// Top-k of one tile's rows (row = row0 + blockIdx.x) over their f32 logits.
// Consumer rows (cblocks != null) build the bitmap of their kept blocks in dynamic
// shared memory (bitmap_words u32).
extern "C" __global__ void __launch_bounds__(TK_THREADS) topk_ragged_f32(
    const float *__restrict__ logits, const u64 *__restrict__ row_off,
    const u32 *__restrict__ row_n, const u32 *__restrict__ row_ks, u32 row0, u32 K,
    i32 *__restrict__ raw, i32 *__restrict__ page, u32 page_cols,
    const i32 *__restrict__ k_slots, const i32 *__restrict__ cblocks, u32 num_blocks,
    u32 block_size, u32 bitmap_words) {
  extern __shared__ u32 bitmap[];
  const u32 row = row0 + blockIdx.x;
  const u32 n = row_n[row];
  if (cblocks) {
    for (u32 i = threadIdx.x; i < bitmap_words; i += TK_THREADS) bitmap[i] = 0;
    __syncthreads();
    for (u32 i = threadIdx.x; i < num_blocks; i += TK_THREADS) {
      const i32 c = cblocks[(u64)row * num_blocks + i];
      if (c >= 0 && (u32)c < bitmap_words * 32u) atomicOr(&bitmap[c >> 5], 1u << (c & 31));
    }
    __syncthreads();
  }
  topk_row<0>(logits + row_off[row], n, K, ~0u, cblocks ? bitmap : nullptr, block_size,
              raw + (u64)row * K, K, page + (u64)row * page_cols, page_cols, k_slots,
              row_ks[row]);
}

// Block keys of the tile's publishing rows: max ranking key over each block of B keys.
// grid: (row blocks, tile rows).
extern "C" __global__ void __launch_bounds__(256) block_keys_f32(
    const float *__restrict__ logits, const u64 *__restrict__ row_off,
    const u32 *__restrict__ row_n, const i32 *__restrict__ row_pub,
    const u64 *__restrict__ row_boff, u32 row0, u32 block_size, u32 *__restrict__ bkeys) {
  const u32 row = row0 + blockIdx.y;
  if (row_pub[row] < 0) return;
  const u32 n = row_n[row];
  const u32 nb = (n + block_size - 1) / block_size;
  const float *s = logits + row_off[row];
  u32 *out = bkeys + row_boff[row];
  for (u32 c = blockIdx.x * blockDim.x + threadIdx.x; c < nb; c += gridDim.x * blockDim.x) {
    const u32 lo = c * block_size, hi = min(lo + block_size, n);
    u32 m = 0;
    for (u32 j = lo; j < hi; ++j) m = max(m, rank_key(s[j]));
    out[c] = m;
  }
}

// Kept blocks of the tile's publishing rows (SPEC 6): the pinned block (n-1)/B first,
// then the best min(NB, nb) - 1 others; ids ascending, -1 padded to NB.
extern "C" __global__ void __launch_bounds__(TK_THREADS) kept_blocks_u32(
    const u32 *__restrict__ bkeys, const u32 *__restrict__ row_n,
    const i32 *__restrict__ row_pub, const u64 *__restrict__ row_boff, u32 row0,
    u32 block_size, u32 num_blocks, i32 *__restrict__ published) {
  const u32 row = row0 + blockIdx.x;
  const i32 p = row_pub[row];
  if (p < 0) return;
  const u32 n = row_n[row];
  const u32 nb = (n + block_size - 1) / block_size;
  const u32 k = min(num_blocks, nb);
  topk_row<1>(bkeys + row_boff[row], nb, k > 0 ? k : 1u, nb > 0 ? nb - 1 : ~0u, nullptr,
              1, published + (u64)p * num_blocks, num_blocks, nullptr, 0, nullptr, 0);
}

// Device codec check: decode every code of each format (SPEC 2).
// out: [256] e4m3 as f32 bits, [16] e2m1 (doubled s8 and e4m3 byte), [256] ue8m0.
extern "C" __global__ void decode_codes(u32 *out_e4m3, u32 *out_e2m1_doubled,
                                        u32 *out_e2m1_e4m3, u32 *out_ue8m0) {
  const u32 i = threadIdx.x;
  if (i < 256) {
    out_e4m3[i] = __float_as_uint(e4m3_decode(i));
    out_ue8m0[i] = __float_as_uint(ue8m0_pow2(i, 0));
  }
  if (i < 16) {
    out_e2m1_doubled[i] = e2m1_doubled_s8(i);
    out_e2m1_e4m3[i] = e2m1_e4m3(i);
  }
}
