// topk: SPEC 5 selection and index assembly, and SPEC 6 kept blocks, on the device.
// block: one row -> its selected ids sorted ascending, -1 padded (raw, page or
//        published), from that row's scores in the tile buffer.
//
// Everything ranks by the order-preserving 32-bit key (rank_key); key 0 marks "not a
// candidate" (a consumer row's keys outside its kept blocks), no score has key 0. Per
// row, the first that applies:
// - shared-memory row (rows of at most the launch's row_cap keys): one pass loads the
//   row's keys into shared memory with an 11-bit histogram, up to two more digit passes
//   there give the exact K-th key (or a threshold that takes exactly K keys), and the
//   ordered pass below reads the keys from there and stages the selected ids there
//   before one coalesced copy out;
// - sampled threshold (long rows, K <= 2048): a sample gives a threshold t (two 11-bit
//   digit passes over it), one pass collects the keys >= t into shared memory, and the
//   exact selection runs there;
// - two passes: an 11-bit histogram finds the K-th key's bin, a second pass collects
//   the keys above it (selected) and in it (candidates, resolved in shared memory);
// - general path: radix_select's four 8-bit digit passes over the row give the exact
//   K-th key T and how many keys equal to T are taken (the lowest j first: SPEC 5's
//   total order), then an ordered pass writes the ids in place with one block scan per
//   chunk: output position = (keys > T before) + min(ties before, taken).
// The sampled threshold and the two passes end with the selected ids sorted in shared
// memory (or hand T to the ordered pass when the row is short next to K); a sampled row
// of at most 32 * TK_SEL_CAP keys marks its selected ids in a bitmap of the row instead
// and writes them out in ascending order from a scan of its bits.
//
// Kernels: topk_ragged_f32 and topk_short_f32 (one row per block, split by length;
// topk_ragged_wide_f32 for tiles of few rows: more candidate slots, fewer blocks per SM),
// topk_segments_f32 and topk_merge_f32 (a long row over several blocks), block_keys_f32
// and kept_blocks_u32 (SPEC 6), decode_codes (the device codec check).

// ==== configuration ====

// Threads per top-k block (kernels::TOPK_THREADS): the shared-memory row's digit scan
// gives each thread 4 of the TK_BINS bins.
#define TK_THREADS 512
#define TK_WARPS (TK_THREADS / 32)
// Consecutive ids per thread in the ordered pass: two 16-byte loads of the shared-memory
// row (kernels::TOPK_CHUNK = TK_THREADS * TK_ITEMS).
#define TK_ITEMS 8
// Pass-1 histogram on the key's top 11 bits.
#define TK_BINS 2048
// Selected ids held for the final sort: the fast paths serve K <= this
// (kernels::TOPK_SEL_CAP).
#define TK_SEL_CAP 4096
// Candidate keys held for the exact resolution; with it TopkSmem is 41 KiB, so that four
// blocks share an SM (kernels::TOPK_CAND_CAP).
#define TK_CAND_CAP 3072
// Candidate keys of topk_ragged_wide_f32 (kernels::TOPK_WIDE_CAP): tiles of at most
// TK_WIDE_MIN_BLOCKS rows per SM (one wave either way) take it, its TopkWideSmem in
// dynamic shared memory. The wider window K .. TK_WIDE_CAP makes a second pass rare: at
// K = 2048 and 131,072 keys its margins are 4 and 6.8 standard deviations of the sample's
// estimate, against 1.8 at TK_CAND_CAP, where about one row in twenty took a second pass,
// and the launch's time is its slowest row's.
#define TK_WIDE_CAP 6144
#ifndef TK_WIDE_MIN_BLOCKS
#define TK_WIDE_MIN_BLOCKS 3
#endif
// Blocks per row of topk_cluster_f32 (kernels::TOPK_CLUSTER): a cluster of them shares one
// sampled row's collecting pass, each block a segment, their candidates gathered into the
// first block's shared memory, which finishes the row alone. Tiles of at most
// sms / TK_CLUSTER rows take it: one block reads a row of 131,072 keys in about 30 us
// (16 rounds of loads, each waiting on the last), eight read it in two rounds each.
#define TK_CLUSTER 8
// Longest row the host sends to the shared-memory row: 64 KiB of keys in dynamic shared
// memory (kernels::TOPK_SHORT_CAP).
#define TK_SHORT_CAP 16384
// 16-byte loads in flight per thread in the shared-memory row's pass over global memory.
#define TK_SHORT_LOADS 4
// TK_SHORT_BITMAP = 1 (a tuning define, not yet measured against the default): a
// shared-memory row whose threshold selects exactly the keys >= T puts its ids in order
// from a bitmap (one ballot a warp per 32 keys, one block scan of the words' counts)
// instead of the ordered pass's block scan per 4,096 keys (about a quarter of
// topk_short_f32's instructions on v32-16k, and three barriers per chunk; NVRTC's ptxas
// keeps its 40 registers with 4 bytes of spills in the copy-out through a slot table).
// 0 (the default): the ordered pass.
#ifndef TK_SHORT_BITMAP
#define TK_SHORT_BITMAP 0
#endif
// TK_COLLECT_MASK = 1 (a tuning define, not yet measured against the default): the
// sampled threshold's collecting pass over f32 rows reserves its candidate slots once per
// round of TK_UNROLL 16-byte loads (a per-lane hit mask, one warp scan, one atomic)
// instead of once per load (ncu on v32-64k fast: the pass is about 46 % of
// topk_ragged_f32's instructions, and at about one key in ten above the threshold nearly
// every load's scan runs). The candidates' order in shared memory changes, which no
// result depends on (the count decides the path; the selection and the ids out are
// functions of the candidate set). NVRTC's ptxas spills in this form: 72 bytes at
// topk_ragged_f32's 32 registers (none by default), 16 in topk_ragged_wide_f32 (4 by
// default), and in topk_ragged_f32 the spills sit in the pass's loop itself (about 18
// local loads and stores a round: the round's four float4 stay live across the scan).
// With TK_UNROLL=2 (two loads a round) that loop has none. 0 (the default): a scan per
// load.
#ifndef TK_COLLECT_MASK
#define TK_COLLECT_MASK 0
#endif
// Rows take the sampled path when n > TK_SAMPLE_RATIO * K and n >= TK_SAMPLE_MIN: at a
// ratio of 16 the selection of v32-64k (K = 2048) ran slower than at 8.
#ifndef TK_SAMPLE_RATIO
#define TK_SAMPLE_RATIO 8
#endif
// Shortest row of the sampled path: its sample of TK_SEL_CAP keys is at most a quarter
// of the row.
#define TK_SAMPLE_MIN 16384
// Loads in flight per thread in the sampled path's collecting pass.
#ifndef TK_UNROLL
#define TK_UNROLL 4
#endif
// Sample chunks in flight per warp in the sample of a row by the kernels of TK_CAND_CAP
// candidates (topk_ragged_f32, topk_segments_f32: 32 registers; ptxas spills 16 bytes in
// the first at every setting, 16 in the second at 8 and 32 at 1): all eight of a warp at
// once, as the wide memory's kernels load them.
// One at a time waits eight memory latencies before the threshold can start (v32-64k
// fast's selection 0.7 to 1.1 % slower in a same-run A/B, benches/RESULTS.md); 1, 2, 4:
// a tuning define (load_sample asserts that it divides a warp's chunks).
#ifndef TK_SAMPLE_LOADS
#define TK_SAMPLE_LOADS 8
#endif
// Sampled rows of at most 32 * TK_SEL_CAP keys emit their selected ids from a bitmap of
// the row in shared memory instead of sorting them (0: the sort, a tuning define).
#ifndef TK_BITMAP
#define TK_BITMAP 1
#endif
// Segments of a split row start at multiples of 4 keys (their length rounded up to one),
// so that every segment takes the sampled pass's 16-byte loads; 0: segments of
// ceil(n / S) keys, most of them misaligned (a tuning define).
#ifndef TK_SEG_ALIGN
#define TK_SEG_ALIGN 1
#endif
// Profiling only (a tuning define; outputs are left unwritten): a sampled row stops
// after its phase TK_STOP (1: the sample's threshold, 2: the collecting pass, 3: the
// exact threshold among the candidates, 4: the ties), 9 every row at once; 0 runs whole.
#ifndef TK_STOP
#define TK_STOP 0
#endif
// Keys in flight per thread in the two passes' reads of a row (load_keys): TK_UNROLL
// over f32 logits (the ragged and segment kernels' 32 registers), 8 over a merge's
// candidate keys. A row of 16,384 keys is then 8 (merge: 4) rounds of loads per pass
// instead of 32 serialized ones.
#define TK_PASS_LOADS(MODE) ((MODE) == 2 ? 8 : TK_UNROLL)
// Rows of at most TK_ORDERED_RATIO * K keys finish a fast path with the ordered pass from
// the exact threshold, cheaper there than the sort of the selected ids.
#define TK_ORDERED_RATIO 16
// Sampled rows take the bitmap of their candidates (TK_BITMAP) at every length it serves,
// the short ones included: the ordered pass reads the whole row a second time, the bitmap
// only the candidates. 1 (a tuning define): sampled rows of at most TK_ORDERED_RATIO * K
// keys finish with the ordered pass as the other fast paths do.
#ifndef TK_SAMPLED_ORDERED
#define TK_SAMPLED_ORDERED 0
#endif
// Blocks per SM the ragged top-k's registers must allow: 4 (32 registers) fits four
// blocks' 41 KiB of shared memory and 2048 threads, so a tile of up to 4 * 132 rows is
// one wave (at ptxas's own 40 registers, 3 blocks, a 512-row tile took two waves).
#ifndef TK_RAGGED_MIN_BLOCKS
#define TK_RAGGED_MIN_BLOCKS 4
#endif
// Blocks per SM of topk_segments_f32: four (32 registers, no spills).
#define TK_SEGMENTS_MIN_BLOCKS 4
// Threads per block_keys_f32 block, one block key each (kernels::BLOCK_KEYS_THREADS).
#define BK_THREADS 256
// Forced fallbacks (test hooks): TK_SHORT=0 never takes the shared-memory row (the host
// reads it too and launches every row through topk_ragged_f32); TK_SAMPLED=0 never takes
// the sampled threshold.
#ifndef TK_SHORT
#define TK_SHORT 1
#endif
#ifndef TK_SAMPLED
#define TK_SAMPLED 1
#endif
static_assert(TK_THREADS % 32 == 0 && TK_THREADS <= 1024, "block size");
static_assert(TK_THREADS * TK_ITEMS <= 65535, "per-chunk counts are packed in 16 bits");
static_assert(TK_ITEMS == 8, "the shared-memory row is read as two uint4 per thread");
static_assert(TK_BINS == 2048, "the digit scan gives each lane 64 bins");
static_assert(!TK_COLLECT_MASK || 4 * TK_UNROLL <= 32,
              "TK_COLLECT_MASK: a round's hits in one 32-bit mask");
static_assert(TK_SHORT_CAP / 32 <= TK_BINS && TK_SHORT_CAP / 32 <= TK_THREADS,
              "the shared-memory row's bitmap: in its histogram, a word a thread at most");
static_assert(4 * TK_THREADS == TK_BINS, "the shared-memory row's scan: 4 digits a thread");
static_assert(TK_SEL_CAP % 32 == 0 && TK_SAMPLE_MIN >= TK_SEL_CAP, "sample chunks");

// ==== path counters ====

// Which path selected a row, counted per launch in `paths[TK_PATH_*]` when the caller
// passes a counter array (src/cuda/kernels.rs mirrors these ids).
#define TK_PATH_ALL 0      // at most K candidates: all taken (m <= K, SPEC 5)
#define TK_PATH_SHORT 1    // the row in shared memory
#define TK_PATH_SAMPLED 2  // sampled threshold, one pass
#define TK_PATH_TWO 3      // two passes, the threshold bin resolved in shared memory
#define TK_PATH_GENERAL 4  // four digit passes over the row
#define TK_PATH_RESAMPLED 5  // sampled threshold, a second pass at a corrected rank
#define TK_PATHS 6

// ==== a row's keys ====

// Where a row's keys come from. Index j is local to the row (or segment): 0 .. n-1.
// MODE 0: f32 logits at scores[lo + j] (ranking key computed here), optional consumer
//         bitmap over blocks of (lo + j).
// MODE 1: u32 block keys, the pinned block forced first.
// MODE 2: candidates idmap[j] (a row id, or -1 for none) with their u32 ranking keys at
//         scores[j] (0 for none): the merge of per-segment selections, whose blocks
//         wrote both, so that the merge reads two arrays in order instead of gathering
//         each candidate's score through its id.
struct RowSrc {
  const void *scores;
  u32 lo;
  const u32 *bitmap;
  u32 block_size;
  u32 pinned;
  const i32 *idmap;
};

// Whether key x (row-relative, lo included) of a consumer row lies in a kept block.
__device__ __forceinline__ bool in_kept_block(const RowSrc &s, u32 x) {
  const u32 c = x / s.block_size;
  return (s.bitmap[c >> 5] >> (c & 31)) & 1u;
}

template <int MODE>
__device__ __forceinline__ u32 load_key(const RowSrc &s, u32 j) {
  if (MODE == 0) {
    const u32 x = s.lo + j;
    if (s.bitmap && !in_kept_block(s, x)) return 0u;
    return rank_key(reinterpret_cast<const float *>(s.scores)[x]);
  } else if (MODE == 1) {
    return j == s.pinned ? 0xFFFFFFFFu : reinterpret_cast<const u32 *>(s.scores)[j];
  } else {
    return reinterpret_cast<const u32 *>(s.scores)[j];
  }
}

// The id written for local index j.
template <int MODE>
__device__ __forceinline__ i32 out_id(const RowSrc &s, u32 j) {
  if (MODE == 2) return s.idmap[j];
  return (i32)(s.lo + j);
}

// Where a selected key's page column points (SPEC 3's k_slots, SPEC 10's pool slots):
// request-local key j sits at slot table[base + (j >> log2)] * 2^log2 + j % 2^log2, base
// the row's row_ks. Flat keys are pages of one slot (log2 0, table k_slots, base the
// request's first flat key); a null table is the identity k_slots, slot base + j. Paged
// keys: table the page table, base the row's first page-table entry.
struct SlotMap {
  const i32 *table;
  u32 base, log2;
  __device__ __forceinline__ i32 slot(const i32 j) const {
    const u32 u = (u32)j;
    if (table == nullptr) return (i32)(base + u);
    return (i32)(((u32)table[(u64)base + (u >> log2)] << log2) | (u & ((1u << log2) - 1u)));
  }
};

// U keys of the row, j = base + u * TK_THREADS + threadIdx.x for u < U (0 past n), every
// load issued before any is used: the loads in flight of a pass over global memory.
template <int MODE, int U>
__device__ __forceinline__ void load_keys(u32 (&key)[U], const RowSrc &src, const u32 base,
                                          const u32 n) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const u32 j = base + u * TK_THREADS + threadIdx.x;
    key[u] = j < n ? load_key<MODE>(src, j) : 0u;
  }
}

// ==== radix select ====

// The fast paths' shared memory (the sampled threshold and the two passes), for CAP
// candidate keys.
template <u32 CAP>
struct TopkSmemT {
  static constexpr u32 cap = CAP;
  union {  // the pass-1 histogram is dead before the candidates are written
    u32 hist[TK_BINS];
    u32 ckey[CAP];
  };
  u32 sel[TK_SEL_CAP];
  u32 cid[CAP];
  u32 h256[256];
  u32 scan[33];
  u32 misc[8];  // 0: bin, 1: remaining, 2: total, 3: nsel, 4: ncand, 5..6: select results
};
using TopkSmem = TopkSmemT<TK_CAND_CAP>;
using TopkWideSmem = TopkSmemT<TK_WIDE_CAP>;
// TopkWideSmem's bytes (kernels::TOPK_WIDE_SMEM).
#define TK_WIDE_SMEM 66724
static_assert(sizeof(TopkWideSmem) == TK_WIDE_SMEM, "the host sizes the wide launch");
static_assert(TK_WIDE_CAP >= TK_BINS && TK_CAND_CAP >= TK_BINS, "hist shares ckey");

// Radix select over `count` keys key(i), largest first (key 0 is "not a candidate" and
// never counted): four 8-bit digit passes, each a histogram of the keys that match the
// digits found so far, give the K-th key T and how many keys equal to T are taken (the
// caller takes the lowest ids among them). EARLY: return false after the first pass when
// at most K keys are candidates (every one is selected; T and take unset). Uses h256 and
// misc[5..7]; ends with a barrier.
template <bool EARLY, class F>
__device__ bool radix_select(u32 *h256, u32 *misc, u32 count, u32 K, F key, u32 &T, u32 &take) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  u32 prefix = 0, mask = 0, remaining = K;
  for (int pass = 0; pass < 4; ++pass) {
    const int shift = 24 - 8 * pass;
    for (int i = tid; i < 256; i += TK_THREADS) h256[i] = 0;
    __syncthreads();
    for (u32 i = tid; i < count; i += TK_THREADS) {
      const u32 k = key(i);
      if (k != 0u && (k & mask) == prefix) atomicAdd(&h256[(k >> shift) & 255u], 1u);
    }
    __syncthreads();
    if (warp == 0) {
      // Lane l owns digits 255-8l .. 248-8l (descending).
      u32 c[8], local = 0;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        c[i] = h256[255 - (lane * 8 + i)];
        local += c[i];
      }
      u32 incl = local;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const u32 y = __shfl_up_sync(FULL_MASK, incl, o);
        if (lane >= o) incl += y;
      }
      const u32 before = incl - local;
      if (pass == 0 && lane == 31) misc[7] = incl;  // candidates in all
      // The digit where the running count reaches `remaining`.
      if (before < remaining && incl >= remaining) {
        u32 cum = before;
        for (int i = 0; i < 8; ++i) {
          if (cum + c[i] >= remaining) {
            misc[5] = prefix | ((u32)(255 - (lane * 8 + i)) << shift);
            misc[6] = remaining - cum;
            break;
          }
          cum += c[i];
        }
      }
    }
    __syncthreads();
    if (EARLY && pass == 0 && misc[7] <= K) return false;
    prefix = misc[5];
    remaining = misc[6];
    mask |= 255u << shift;
    __syncthreads();
  }
  T = prefix;
  take = remaining;
  return true;
}

// ==== the shared-memory row ====

// The shared-memory row's static shared memory (TopkSmem's fields of the same names).
struct ShortSmem {
  u32 hist[TK_BINS + 4];  // short_row_threshold counts non-matching keys at TK_BINS
  u32 scan[33];
  u32 misc[8];
};

// The shared-memory row: buf (capacity at least ceil8(n), 16-byte aligned) receives the
// row's n keys, read with 16-byte loads (MODE 0: f32 logits, the row 16-byte aligned in
// global memory: rows start at multiples of ROW_ALIGN floats, and the padding up to the
// next multiple of 4 is inside the row's footprint), and digit passes of 11, 11 and 10
// bits find the K-th key T and how many keys equal to T are taken (the caller takes the
// lowest ids among them). The first pass histograms the keys as they arrive from global
// memory; the others read buf. Each pass ends in one block scan of the histogram from
// its top digit. False when at most K keys are candidates (every one is selected; T and
// take unset). Uses hist, scan and misc[0..2]. Further:
// - keys that are not candidates (0: past n, or outside a consumer's kept blocks) go to
//   bin 0 in the first pass, which the scan skips: every real key is >= 0x007FFFFF, bin
//   3 or above;
// - the later passes count every key, at min((k - prefix) >> shift, TK_BINS), without a
//   branch: a key that matches the digits found so far lands on its digit, any other at
//   or past `bins`, which the scan does not read (k - prefix wraps above 2^23 for
//   k < prefix, as prefix >= 3 << 21). The increments of one address in a warp are one
//   shared-memory operation (ATOMS.POPC.INC). A predicated increment instead compiles
//   to a branch around each atomic, 8 instructions a key against 5;
// - a pass stops the search when the digit found holds exactly the keys still needed:
//   then every key >= that digit's lowest key is selected, exactly K of them, with no
//   tie to break. `ge` says so, with T that lowest key. With continuous scores the
//   second pass's 22-bit bucket usually holds the K-th key alone, and the third pass
//   is skipped. The last pass's digit is a single key value: ge also when every key
//   equal to T is taken.
template <int MODE, class Smem>
__device__ bool short_row_threshold(Smem &sm, u32 *buf, const RowSrc &src, const u32 n,
                                    const u32 K, u32 &T, u32 &take, bool &ge) {
  static_assert(MODE == 0, "f32 logits");
  const int tid = threadIdx.x;
  for (int i = tid; i < TK_BINS; i += TK_THREADS) sm.hist[i] = 0;
  __syncthreads();
  const float4 *row4 =
      reinterpret_cast<const float4 *>(reinterpret_cast<const float *>(src.scores) + src.lo);
  uint4 *buf4 = reinterpret_cast<uint4 *>(buf);
  const u32 n4 = (n + 3u) / 4u;
  constexpr int V = TK_SHORT_LOADS;
  for (u32 base = 0; base < n4; base += V * TK_THREADS) {
    float4 v[V];
#pragma unroll
    for (int u = 0; u < V; ++u) {
      const u32 q = base + u * TK_THREADS + tid;
      if (q < n4) v[u] = row4[q];
    }
#pragma unroll
    for (int u = 0; u < V; ++u) {
      const u32 q = base + u * TK_THREADS + tid;
      if (q < n4) {
        u32 k[4] = {rank_key(v[u].x), rank_key(v[u].y), rank_key(v[u].z), rank_key(v[u].w)};
        if (src.bitmap != nullptr || 4u * q + 4u > n) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const u32 j = 4u * q + i;
            if (j >= n) {
              k[i] = 0u;
            } else if (src.bitmap != nullptr && !in_kept_block(src, src.lo + j)) {
              k[i] = 0u;
            }
          }
        }
        buf4[q] = make_uint4(k[0], k[1], k[2], k[3]);
#pragma unroll
        for (int i = 0; i < 4; ++i) atomicAdd(&sm.hist[k[i] >> 21], 1u);
      }
    }
  }
  __syncthreads();
  u32 prefix = 0, need = K;
  for (int pass = 0; pass < 3; ++pass) {
    const int shift = pass == 0 ? 21 : pass == 1 ? 10 : 0;  // the digit's lowest bit
    const u32 bins = pass == 2 ? 1024u : 2048u;
    if (pass > 0) {
      for (int i = tid; i < TK_BINS; i += TK_THREADS) sm.hist[i] = 0;
      __syncthreads();
      for (u32 q = tid; q < n4; q += TK_THREADS) {
        const uint4 k = buf4[q];
        atomicAdd(&sm.hist[min((k.x - prefix) >> shift, (u32)TK_BINS)], 1u);
        atomicAdd(&sm.hist[min((k.y - prefix) >> shift, (u32)TK_BINS)], 1u);
        atomicAdd(&sm.hist[min((k.z - prefix) >> shift, (u32)TK_BINS)], 1u);
        atomicAdd(&sm.hist[min((k.w - prefix) >> shift, (u32)TK_BINS)], 1u);
      }
      __syncthreads();
    }
    // Thread t owns digits bins-1-4t .. bins-4-4t (descending); the first pass's bin 0
    // holds the keys that are not candidates.
    u32 c[4], local = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const u32 idx = 4u * tid + i;
      c[i] = idx < bins && (pass > 0 || idx != bins - 1u) ? sm.hist[bins - 1u - idx] : 0u;
      local += c[i];
    }
    u32 total;
    const u32 before = block_exclusive_scan(local, sm.scan, &total);
    if (pass == 0 && total <= K) return false;  // m <= K: every candidate
    if (before < need && before + local >= need) {
      u32 cum = before;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if (cum + c[i] >= need) {
          sm.misc[0] = prefix | ((bins - 1u - (4u * tid + i)) << shift);
          sm.misc[1] = need - cum;
          sm.misc[2] = need - cum == c[i];  // the digit's keys are all taken
          break;
        }
        cum += c[i];
      }
    }
    __syncthreads();
    prefix = sm.misc[0];
    need = sm.misc[1];
    ge = sm.misc[2] != 0u;
    if (ge) break;
    // misc is next written after the next pass's histogram barrier.
  }
  T = prefix;
  take = need;
  return true;
}

// TK_SHORT_BITMAP: the shared-memory row's ids of the keys >= T (short_row_threshold's
// `ge`: exactly K of them) into buf[0 ..), ascending; returns their count. The keys as
// bits in sm.hist (dead since the threshold's last barrier): word w holds keys
// 32 w .. 32 w + 31, lane l's bit key 32 w + l, one ballot a warp per word (keys past n,
// and keys that are not candidates, are 0 < T). Then thread t takes word t (at most one a
// thread) and writes its ids after those of the threads before it. Every read of buf ends
// at the barrier before the scan, ahead of the ids that overwrite it. Uses hist and scan.
template <class Smem>
__device__ u32 short_bitmap_ids(Smem &sm, u32 *buf, const u32 n, const u32 T) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const u32 words = (n + 31u) / 32u;
  // Four words a warp per round, their loads issued together.
  for (u32 w0 = warp; w0 < words; w0 += 4u * TK_WARPS) {
    u32 k[4];
#pragma unroll
    for (u32 u = 0; u < 4u; ++u) {
      const u32 j = 32u * (w0 + u * TK_WARPS) + lane;
      k[u] = j < n ? buf[j] : 0u;
    }
#pragma unroll
    for (u32 u = 0; u < 4u; ++u) {
      const u32 b = __ballot_sync(FULL_MASK, k[u] >= T);
      if (lane == 0 && w0 + u * TK_WARPS < words) sm.hist[w0 + u * TK_WARPS] = b;
    }
  }
  __syncthreads();
  const u32 bits = (u32)tid < words ? sm.hist[tid] : 0u;
  u32 count;
  u32 c = block_exclusive_scan((u32)__popc(bits), sm.scan, &count);
  for (u32 b = bits; b != 0u; b &= b - 1u, ++c) buf[c] = 32u * (u32)tid + (u32)(__ffs(b) - 1);
  return count;
}

// ==== the sampled threshold ====

// Sampled threshold (one pass over long rows): a sample of TK_SEL_CAP keys in chunks of
// 32, a threshold t near its rank-r key with about `target` keys of the row expected at
// or above it, for CAP candidate slots (TK_CAND_CAP, or TK_WIDE_CAP in
// topk_ragged_wide_f32): CAP / 2 when 3 K <= CAP (K <= 1024 at TK_CAND_CAP), else
// (K + CAP) / 2, midway between too few (< K) and too many (> CAP), for K up to 2048
// at TK_CAND_CAP (3 K <= 2 CAP); rows of at least TK_SAMPLE_MIN keys and
// n > TK_SAMPLE_RATIO K. At TK_CAND_CAP the narrowest margin is K = 2048's, +-20 %: for
// n <= 64 K that is at least 2.5 standard deviations of the sampled estimate (rank
// r >= 160), and a miss costs a second pass. (The midpoint for every K misses often at small K: at K = 512 and
// n = 1 M the rank is 7, and the upper margin is narrower.)

// Whether a row of n keys takes the sampled threshold, for CAP candidate slots (MODE 0:
// f32 logits); never at K > TK_SEL_CAP, which topk_row_fast does not serve.
template <int MODE>
__device__ __forceinline__ bool sampled_row(const u32 n, const u32 K, const u32 cap) {
  return TK_SAMPLED && MODE == 0 && K <= TK_SEL_CAP && n >= TK_SAMPLE_MIN &&
         n > (u32)TK_SAMPLE_RATIO * K && 3u * K <= 2u * cap;
}

// ==== clusters (topk_cluster_f32) ====

// This block's rank in its cluster.
__device__ __forceinline__ u32 cluster_rank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// A barrier of every thread of the cluster; shared-memory writes before it are visible to
// every block of the cluster after it.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" :::
                   "memory");
}
// The generic address of the object at p (this block's shared memory) in block `rank`.
template <class T>
__device__ __forceinline__ T *cluster_map(T *p, const u32 rank) {
  u64 out;
  asm volatile("mapa.u64 %0, %1, %2;" : "=l"(out) : "l"((u64)p), "r"(rank));
  return reinterpret_cast<T *>(out);
}

// The end of the sampled threshold's collecting pass: whether its count of keys >= t
// (misc[4]) lies in K .. CAP. Every thread reads the count after the pass's
// barrier; on a miss a second barrier follows, because the caller's two-pass path then
// resets misc (and the histogram over ckey) while a slower warp could still be reading it.
// The result is the same in every thread, so both barriers are reached by all.
template <class Sm>
__device__ __forceinline__ bool sampled_count_fits(Sm &sm, const u32 K) {
  __syncthreads();
  const u32 count = sm.misc[4];
  const bool fits = count >= K && count <= Sm::cap;
  if (!fits) __syncthreads();
  return fits;
}

// A warp's `cnt` slots per lane reserved on `counter` with one shared-memory atomic (a
// warp scan of the lanes' counts): this lane's first slot. Every lane of the warp calls it.
__device__ __forceinline__ u32 warp_reserve(const u32 cnt, u32 *counter) {
  const int lane = threadIdx.x & 31;
  u32 incl = cnt;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const u32 y = __shfl_up_sync(FULL_MASK, incl, o);
    if (lane >= o) incl += y;
  }
  u32 at = 0;
  if (lane == 31) at = atomicAdd(counter, incl);
  return __shfl_sync(FULL_MASK, at, 31) + incl - cnt;
}

// The collecting pass of the sampled threshold: appends every key >= t of the row (and
// its id) to ckey / cid, the first CAP of them, and counts them all in misc[4]
// (which the caller has zeroed). t >= 1: key 0 ("not a candidate") is never collected.
// Ids are written as id0 + j (a cluster's segment at id0 of its row).
template <int MODE, class Sm>
__device__ __forceinline__ void collect_at_least(Sm &sm, const RowSrc &src, const u32 n,
                                                 const u32 t, const u32 id0 = 0u) {
  const int tid = threadIdx.x, lane = tid & 31;
  if (MODE == 0 && src.bitmap == nullptr && (src.lo & 3u) == 0u &&
      t > 0x007FFFFFu) {
    // f32 logits, 16-byte aligned from the row's (or segment's) start, read as float4
    // past n up to the next multiple of 4: inside the row's footprint (rows start at
    // multiples of ROW_ALIGN floats; a segment's tail is its row's next keys), masked.
    // rank_key(x) >= t is x >= ft in f32 order, ft the value whose key is t, for every
    // x but NaN (key of -inf): t > key(-inf) excludes NaN on both sides. -0 == +0 in
    // f32 order, as in the key. The key is computed only for the hits.
    const float ft = __uint_as_float((t & 0x80000000u) ? (t & 0x7FFFFFFFu) : ~t);
    const float4 *row4 =
        reinterpret_cast<const float4 *>(reinterpret_cast<const float *>(src.scores) + src.lo);
    const u32 n4 = (n + 3u) / 4u;
    constexpr int V = TK_UNROLL;  // 16-byte loads in flight per thread
    for (u32 base = 0; base < n4; base += V * TK_THREADS) {
      float4 v[V];
#pragma unroll
      for (int u = 0; u < V; ++u) {
        const u32 q = base + u * TK_THREADS + tid;
        v[u] = q < n4 ? row4[q] : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#if TK_COLLECT_MASK
      // The round's hits as a mask (bit 4 u + i: key i of load u), then one warp scan
      // and one atomic for all V loads.
      u32 mask = 0;
#pragma unroll
      for (int u = 0; u < V; ++u) {
        const u32 q = base + u * TK_THREADS + tid;
        const float x[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
#pragma unroll
        for (int i = 0; i < 4; ++i)
          if (q < n4 && x[i] >= ft && 4u * q + i < n) mask |= 1u << (4 * u + i);
      }
      if (__ballot_sync(FULL_MASK, mask != 0u) == 0u) continue;
      u32 at = warp_reserve((u32)__popc(mask), &sm.misc[4]);
#pragma unroll
      for (int u = 0; u < V; ++u) {
        const u32 q = base + u * TK_THREADS + tid;
        const float x[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          if (mask & (1u << (4 * u + i))) {
            if (at < Sm::cap) {
              sm.ckey[at] = rank_key(x[i]);
              sm.cid[at] = id0 + 4u * q + i;
            }
            ++at;
          }
        }
      }
#else
#pragma unroll
      for (int u = 0; u < V; ++u) {
        const u32 q = base + u * TK_THREADS + tid;
        const float x[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
        bool h[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) h[i] = q < n4 && x[i] >= ft && 4u * q + i < n;
        if (__ballot_sync(FULL_MASK, h[0] || h[1] || h[2] || h[3]) == 0u) continue;
        // A warp's candidates reserved with one shared-memory atomic per four keys of
        // each lane.
        u32 at = warp_reserve((u32)h[0] + (u32)h[1] + (u32)h[2] + (u32)h[3], &sm.misc[4]);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          if (h[i]) {
            if (at < Sm::cap) {
              sm.ckey[at] = rank_key(x[i]);
              sm.cid[at] = id0 + 4u * q + i;
            }
            ++at;
          }
        }
      }
#endif
    }
    return;
  }
  constexpr int U = TK_UNROLL;  // independent loads in flight per thread
  for (u32 base = 0; base < n; base += U * TK_THREADS) {
    u32 key[U];
    load_keys<MODE>(key, src, base, n);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const bool hit = key[u] >= t;
      const u32 m = __ballot_sync(FULL_MASK, hit);
      if (m) {
        const int leader = __ffs(m) - 1;
        u32 at = 0;
        if (lane == leader) at = atomicAdd(&sm.misc[4], (u32)__popc(m));
        at = __shfl_sync(FULL_MASK, at, leader) + __popc(m & ((1u << lane) - 1u));
        if (hit && at < Sm::cap) {
          sm.ckey[at] = key[u];
          sm.cid[at] = id0 + base + u * TK_THREADS + tid;
        }
      }
    }
  }
}

// The first block of a cluster of CL gathers the candidates the others collected: block
// r's count c_r (misc[4]) and its first c_r keys and ids, appended after those of the
// blocks before it, as far as CAP reaches (block r holds the first min(c_r, CAP) of its
// own, at least what fits); then misc[4] = the cluster's count, which the one-block pass
// would have counted. Its own candidates stay in place. Between two cluster barriers.
template <int CL, class Sm>
__device__ __forceinline__ void cluster_gather(Sm &sm) {
  constexpr u32 CAP = Sm::cap;
  u32 count[CL], off[CL], take[CL];
  u32 total = 0, most = 0;
#pragma unroll
  for (int r = 0; r < CL; ++r) {
    count[r] = cluster_map(&sm.misc[4], (u32)r)[0];
    off[r] = total;
    take[r] = off[r] < CAP ? min(count[r], CAP - off[r]) : 0u;
    total += count[r];
    if (r > 0) most = max(most, take[r]);
  }
  for (u32 i = threadIdx.x; i < most; i += TK_THREADS) {
    u32 key[CL], id[CL];
#pragma unroll
    for (int r = 1; r < CL; ++r) {
      if (i < take[r]) {
        key[r] = cluster_map(&sm.ckey[i], (u32)r)[0];
        id[r] = cluster_map(&sm.cid[i], (u32)r)[0];
      }
    }
#pragma unroll
    for (int r = 1; r < CL; ++r) {
      if (i < take[r]) {
        sm.ckey[off[r] + i] = key[r];
        sm.cid[off[r] + i] = id[r];
      }
    }
  }
  __syncthreads();  // every thread has read this block's count
  if (threadIdx.x == 0) sm.misc[4] = total;
}

// A threshold from the sample in sel (TK_SEL_CAP keys, 0 for none): two digit passes of
// 11 bits find the 22-bit bucket that holds the sample's rank-r key; t is that bucket's
// lowest key, so at least r sample keys are >= t, fewer than r above its bucket.
// `sampled`: the non-zero keys of the sample (when below r, t is 0). Uses hist (ckey's
// memory: dead until the collecting pass), scan and misc[5..6]; ends with a barrier.
template <class Sm>
__device__ u32 sample_threshold_22(Sm &sm, const u32 r, u32 &sampled) {
  const int tid = threadIdx.x;
  u32 prefix = 0, need = r;
  for (int pass = 0; pass < 2; ++pass) {
    const int shift = pass == 0 ? 21 : 10;
    for (int i = tid; i < TK_BINS; i += TK_THREADS) sm.hist[i] = 0;
    __syncthreads();
    for (u32 i = tid; i < TK_SEL_CAP; i += TK_THREADS) {
      const u32 k = sm.sel[i];
      if (pass == 0 ? k != 0u : (k >> 21) == (prefix >> 21))
        atomicAdd(&sm.hist[(k >> shift) & (TK_BINS - 1u)], 1u);
    }
    __syncthreads();
    // Thread t owns digits 2047-4t .. 2044-4t (descending).
    u32 c[4], local = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      c[i] = sm.hist[TK_BINS - 1u - (4u * tid + i)];
      local += c[i];
    }
    u32 total;
    const u32 before = block_exclusive_scan(local, sm.scan, &total);
    if (pass == 0) {
      sampled = total;
      if (total < need) return 0u;  // block-wide: every thread returns
    }
    if (before < need && before + local >= need) {
      u32 cum = before;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if (cum + c[i] >= need) {
          sm.misc[5] = prefix | ((TK_BINS - 1u - (4u * tid + i)) << shift);
          sm.misc[6] = need - cum;
          break;
        }
        cum += c[i];
      }
    }
    __syncthreads();
    prefix = sm.misc[5];
    need = sm.misc[6];
    __syncthreads();  // misc and hist are rewritten next
  }
  return prefix;
}

// A sample of CH chunks of 32 keys into dst: chunk c, the 32 keys from start(c), at
// dst[32 c ..], warp w taking chunks w, w + TK_WARPS, ..., L of them in flight per lane
// at a time; on_key(k) sees each key this thread loads. No barrier.
template <int MODE, u32 CH, u32 L, class Start, class OnKey>
__device__ __forceinline__ void load_sample(u32 *dst, const RowSrc &src, const Start start,
                                            const OnKey on_key) {
  static_assert(CH % (L * TK_WARPS) == 0, "whole rounds of sample chunks per warp");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (u32 c0 = warp; c0 < CH; c0 += L * TK_WARPS) {
    u32 v[L];
#pragma unroll
    for (u32 i = 0; i < L; ++i) v[i] = load_key<MODE>(src, start(c0 + i * TK_WARPS) + lane);
#pragma unroll
    for (u32 i = 0; i < L; ++i) {
      dst[(c0 + i * TK_WARPS) * 32 + lane] = v[i];
      on_key(v[i]);
    }
  }
}

// The second threshold of a row whose first collecting pass found c > CAP keys >= t: a
// second sample of CAP keys into ckey (free: the second pass rewrites it), chunks of 32
// at the midpoints of CH2 equal steps over the row. Their spacing is not the first
// sample's, so most of them lie outside its chunks and a first sample that misjudged the
// row (its chunks all low) does not misjudge it again. q of its keys are >= t; the c row
// keys >= t stand to them as c / q, so its rank-q2 key, q2 = ceil(q target / c), has
// about `target` row keys at or above it (chunks that overlap the first sample's count in
// q too, so the proportion holds). Returns t (no higher threshold: the caller misses)
// when q is 0. Uses scan, h256 and misc[5..7]; ends with a barrier.
template <int MODE, class Sm>
__device__ u32 second_sample_threshold(Sm &sm, const RowSrc &src, const u32 n, const u32 t,
                                       const u32 c, const u32 target) {
  constexpr u32 S2 = Sm::cap, CH2 = S2 / 32;
  static_assert(S2 % 32 == 0, "second sample chunks");
  u32 q = 0;
  load_sample<MODE, CH2, 1>(
      sm.ckey, src, [&](const u32 ch) { return (u32)(((u64)(2 * ch + 1) * (n - 32)) / (2 * CH2)); },
      [&](const u32 k) { q += k >= t; });
  u32 total;
  block_exclusive_scan(q, sm.scan, &total);  // ends with a barrier
  if (total == 0u) return t;  // the caller's miss path runs the barrier before any reset
  const u32 q2 = (u32)(((u64)total * target + c - 1) / c);  // in 1 .. total
  u32 t2, unused;
  radix_select<false>(sm.h256, sm.misc, S2, q2, [&](u32 i) { return sm.ckey[i]; }, t2, unused);
  return t2;
}

// The sampled threshold: a sample of the row into sm.sel, a threshold t from it, then one pass
// that appends every key >= t (and its id) to ckey / cid. When that pass's count c misses
// K .. CAP, a second pass from a threshold t2 whose count is estimated from c:
// - c > CAP: t2 from a second sample (second_sample_threshold), of CAP keys mostly at
//   other places than the first's: q of them are >= t, so about c q2 / q of the row's
//   keys are >= its rank-q2 key, q2 = ceil(q target / c);
// - c < K: t2 is the sample's rank-r2 key, r2 = r * target / c.
// Both depend on the row alone (never on which CAP of the c keys the pass kept, which the
// schedule sets), so a row's path is the same on every run.
// (At K = 512 of 1 M keys the sample's rank r is 7, and about one row in twenty misses.)
// Returns TK_SAMPLE_FIRST or TK_SAMPLE_SECOND, with misc[4] = count and misc[3] = 0, when
// the last pass's count lies in K .. CAP: then the K-th key of the row is >= its
// threshold, so the candidates hold every key the exact selection can take, ties
// included (keys left out are below it). TK_SAMPLE_MISS otherwise (the caller starts
// over). The result is the same in every thread.
#define TK_SAMPLE_MISS 0
#define TK_SAMPLE_FIRST 1
#define TK_SAMPLE_SECOND 2
#define TK_SAMPLE_STOP 3
#define TK_SAMPLE_HELPER 4
//
// CL > 1 (topk_cluster_f32): every block of the cluster draws the same sample and finds
// the same t; each then collects the keys >= t of its segment of the row (starts at
// multiples of 4 keys) into its own shared memory, and the first block gathers them all
// (cluster_gather) and goes on alone. The other blocks return TK_SAMPLE_HELPER once the
// first has read their memory. Either every block of the cluster takes both cluster
// barriers or none does: each block's decisions before them depend only on the row.
template <int MODE, int CL = 1, class Sm>
__device__ int sampled_candidates(Sm &sm, const RowSrc &src, const u32 n, const u32 K) {
  constexpr u32 CAP = Sm::cap;
  const int tid = threadIdx.x;
  constexpr u32 S = TK_SEL_CAP, CH = S / 32, PER = CH / TK_WARPS;
  // Chunks spread evenly: chunk c's first key. A warp's chunks are loaded together in
  // the wide memory's kernels (at most 3 blocks per SM, registers to spare), and
  // TK_SAMPLE_LOADS at a time in the others.
  constexpr u32 L = CAP == TK_WIDE_CAP ? PER : TK_SAMPLE_LOADS;
  load_sample<MODE, CH, L>(
      sm.sel, src, [&](const u32 c) { return (u32)(((u64)c * (n - 32)) / (CH - 1)); },
      [](u32) {});
  if (tid < 8) sm.misc[tid] = 0;
  __syncthreads();
  const u32 target = 3u * K <= CAP ? CAP / 2 : (K + CAP) / 2;
  const u32 r = (u32)(((u64)target * S + n - 1) / n);  // in 1 .. S
  u32 t, unused, sampled;
  t = sample_threshold_22(sm, r, sampled);
  // A row that ends here: a cluster's helper blocks stop as helpers, and the first
  // block counts the row's path.
  const auto end_row = [&](const int path) {
    return CL > 1 && cluster_rank() != 0u ? TK_SAMPLE_HELPER : path;
  };
  if (TK_STOP == 1) return end_row(TK_SAMPLE_STOP);
  if (sampled < r) {  // fewer than r candidates sampled (a consumer's bitmap)
    __syncthreads();  // every thread has read misc before the caller's fallback resets it
    return end_row(TK_SAMPLE_MISS);
  }
  if constexpr (CL > 1) {
    const u32 rank = cluster_rank();
    const u32 seg = ((n + CL - 1u) / CL + 3u) & ~3u;
    const u32 lo = min(n, rank * seg), hi = min(n, lo + seg);
    RowSrc part = src;
    part.lo = src.lo + lo;
    collect_at_least<MODE>(sm, part, hi - lo, t, lo);
    cluster_sync();  // every block's candidates and count (misc[4]) are in its memory
    if (rank != 0u) {
      cluster_sync();  // the first block has gathered them
      return TK_SAMPLE_HELPER;
    }
    cluster_gather<CL>(sm);
    cluster_sync();
  } else {
    collect_at_least<MODE>(sm, src, n, t);
    __syncthreads();
  }
  if (TK_STOP == 2) return TK_SAMPLE_STOP;
  const u32 c = sm.misc[4];
  if (c >= K && c <= CAP) return TK_SAMPLE_FIRST;
  // The second threshold (radix_select starts and ends with barriers: every thread has
  // read c before misc[4] is reset, and ckey before the second pass overwrites it).
  u32 t2;
  if (c > CAP) {
    t2 = second_sample_threshold<MODE>(sm, src, n, t, c, target);
    if (t2 <= t) {  // no higher threshold in the second sample
      __syncthreads();
      return TK_SAMPLE_MISS;
    }
  } else {
    const u32 r2 = (u32)min((u64)sampled, ((u64)r * target + c - 1) / max(c, 1u));
    if (r2 <= r) {  // no lower threshold in the sample
      __syncthreads();
      return TK_SAMPLE_MISS;
    }
    radix_select<false>(sm.h256, sm.misc, S, r2, [&](u32 i) { return sm.sel[i]; }, t2, unused);
  }
  if (tid == 0) sm.misc[4] = 0;
  __syncthreads();
  collect_at_least<MODE>(sm, src, n, t2);
  return sampled_count_fits(sm, K) ? TK_SAMPLE_SECOND : TK_SAMPLE_MISS;
}

// ==== the fast paths ====

// A fast path's K selected local ids, ascending, id_at(c) for c < K, written out: raw ids
// (out_cols of them) and page slots (page_cols), -1 past K. The block's threads stride
// the columns.
template <int MODE, class F>
__device__ __forceinline__ void write_sorted_ids(const F id_at, const RowSrc &src, const u32 K,
                                                 i32 *out_ids, const u32 out_cols,
                                                 i32 *out_page, const u32 page_cols,
                                                 const SlotMap slots) {
  const int tid = threadIdx.x;
  for (u32 c = tid; c < out_cols; c += TK_THREADS) {
    const i32 j = c < K ? out_id<MODE>(src, id_at(c)) : -1;
    out_ids[c] = j;
    if (out_page && c < page_cols)
      out_page[c] = c < K ? slots.slot(j) : -1;
  }
  if (out_page)
    for (u32 c = out_cols + tid; c < page_cols; c += TK_THREADS) out_page[c] = -1;
}

// The sampled threshold or the two passes, then the exact selection in shared memory.
// The general path is needed for K above TK_SEL_CAP, or more than CAP keys in the
// threshold bin. Returns TK_FALLBACK (nothing written: the general path), TK_DONE
// (outputs written), or TK_THRESHOLD (exact K-th key in *T_out, ties to take in
// *take_out: the ordered pass finishes, cheaper than the sort for rows of at most
// TK_ORDERED_RATIO * K keys).
#define TK_FALLBACK 0
#define TK_DONE 1
#define TK_THRESHOLD 2
#define TK_HELPER 3  // a cluster's other block: its part is done, nothing written
template <int MODE, int CL = 1, class Sm>
__device__ int topk_row_fast(Sm &sm, const RowSrc &src, const u32 n, const u32 K,
                             i32 *out_ids, const u32 out_cols, i32 *out_page,
                             const u32 page_cols, const SlotMap slots,
                             u32 *T_out, u32 *take_out, int *path) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (K > TK_SEL_CAP) return TK_FALLBACK;
  u32 need;
  const int sampled = sampled_row<MODE>(n, K, Sm::cap)
                          ? sampled_candidates<MODE, CL>(sm, src, n, K)
                          : TK_SAMPLE_MISS;
  if (sampled == TK_SAMPLE_STOP) return TK_DONE;
  if (CL > 1 && sampled == TK_SAMPLE_HELPER) return TK_HELPER;
  if (sampled != TK_SAMPLE_MISS) {
    need = K;  // every candidate is a key >= the threshold; none selected yet
    *path = sampled == TK_SAMPLE_FIRST ? TK_PATH_SAMPLED : TK_PATH_RESAMPLED;
  } else {
  *path = TK_PATH_TWO;
  // Pass 1: histogram of the top 11 bits.
  for (int i = tid; i < TK_BINS; i += TK_THREADS) sm.hist[i] = 0;
  if (tid < 8) sm.misc[tid] = 0;
  __syncthreads();
  for (u32 base = 0; base < n; base += TK_PASS_LOADS(MODE) * TK_THREADS) {
    u32 key[TK_PASS_LOADS(MODE)];
    load_keys<MODE>(key, src, base, n);
#pragma unroll
    for (int u = 0; u < TK_PASS_LOADS(MODE); ++u)
      if (key[u] != 0u) atomicAdd(&sm.hist[key[u] >> 21], 1u);
  }
  __syncthreads();
  if (warp == 0) {
    // Lane l owns bins 2047-64l .. 1984-64l (descending).
    u32 local = 0;
    for (int i = 0; i < 64; ++i) local += sm.hist[TK_BINS - 1 - (lane * 64 + i)];
    u32 incl = local;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const u32 y = __shfl_up_sync(FULL_MASK, incl, o);
      if (lane >= o) incl += y;
    }
    const u32 total = __shfl_sync(FULL_MASK, incl, 31);
    const u32 before = incl - local;
    if (lane == 0) sm.misc[2] = total;
    if (total > K && before < K && incl >= K) {
      u32 cum = before;
      for (int i = 0; i < 64; ++i) {
        const u32 b = TK_BINS - 1 - (lane * 64 + i);
        if (cum + sm.hist[b] >= K) {
          sm.misc[0] = b;
          sm.misc[1] = K - cum;  // keys taken from bin b
          break;
        }
        cum += sm.hist[b];
      }
    }
  }
  __syncthreads();
  const u32 total = sm.misc[2];
  if (total <= K) return TK_FALLBACK;  // m <= K: the general path selects all in one pass
  const u32 bin = sm.misc[0];
  need = sm.misc[1];
  const u32 in_bin = sm.hist[bin];
  __syncthreads();  // hist shares its memory with ckey, written below
  if (in_bin > Sm::cap) return TK_FALLBACK;
  // Pass 2: keys above the bin are selected; the bin's keys are candidates.
  for (u32 base = 0; base < n; base += TK_PASS_LOADS(MODE) * TK_THREADS) {
    u32 key[TK_PASS_LOADS(MODE)];
    load_keys<MODE>(key, src, base, n);
#pragma unroll
    for (int u = 0; u < TK_PASS_LOADS(MODE); ++u) {
      const u32 j = base + u * TK_THREADS + tid, b = key[u] >> 21;
      if (key[u] == 0u) continue;
      if (b > bin) {
        sm.sel[atomicAdd(&sm.misc[3], 1u)] = j;
      } else if (b == bin) {
        const u32 c = atomicAdd(&sm.misc[4], 1u);
        sm.ckey[c] = key[u];
        sm.cid[c] = j;
      }
    }
  }
  __syncthreads();
  }
  const u32 ncand = sm.misc[4];
  // Exact threshold among the bin's keys, then the lowest ids among its ties.
  u32 T, take;
  radix_select<false>(sm.h256, sm.misc, ncand, need, [&](u32 i) { return sm.ckey[i]; }, T, take);
  if (TK_STOP == 3 && sampled != TK_SAMPLE_MISS) return TK_DONE;
  const bool bitmap_row =
      TK_BITMAP && !TK_SAMPLED_ORDERED && sampled != TK_SAMPLE_MISS && n <= 32u * TK_SEL_CAP;
  if (n <= (u32)TK_ORDERED_RATIO * K && !bitmap_row) {
    *T_out = T;
    *take_out = take;
    return TK_THRESHOLD;
  }
  u32 ties = 0;
  for (u32 i = tid; i < ncand; i += TK_THREADS) ties += sm.ckey[i] == T;
  // Count ties block-wide.
  {
    u32 tot;
    block_exclusive_scan(ties, sm.scan, &tot);
    ties = tot;
  }
  u32 Tj = 0;  // ties with ~id >= Tj are taken (the `take` lowest ids)
  if (take < ties)
    radix_select<false>(sm.h256, sm.misc, ncand, take,
                        [&](u32 i) { return sm.ckey[i] == T ? ~sm.cid[i] : 0u; }, Tj, take);
  if (TK_STOP == 4 && sampled != TK_SAMPLE_MISS) return TK_DONE;
  auto taken = [&](u32 i) {
    const u32 key = sm.ckey[i];
    return key > T || (key == T && ~sm.cid[i] >= Tj);
  };
#if TK_BITMAP
  // A sampled row of at most 32 TK_SEL_CAP keys: every candidate came from the one pass,
  // and sel (free since the sample) holds a bit per key: the K selected ids come out in
  // ascending order from a scan of the bits, no sort. Each thread puts the ids of its
  // run of words in place in shared memory, and the block copies them out a row at a
  // time: written straight from the scan, a warp's stores spread over four times the
  // lines and wait on its lane with the most ids (v32-64k fast's selection 8 % slower,
  // benches/RESULTS.md).
  if (sampled != TK_SAMPLE_MISS && n <= 32u * TK_SEL_CAP) {
    u32 *bits = sm.sel;
    const u32 words = (n + 31u) / 32u;
    for (u32 w = tid; w < words; w += TK_THREADS) bits[w] = 0u;
    __syncthreads();
    for (u32 i = tid; i < ncand; i += TK_THREADS)
      if (taken(i)) atomicOr(&bits[sm.cid[i] >> 5], 1u << (sm.cid[i] & 31u));
    __syncthreads();
    // Thread tid's words: a run of W, so that its ids follow those of the threads before.
    const u32 W = (words + TK_THREADS - 1u) / TK_THREADS;
    const u32 w0 = min(tid * W, words), w1 = min(w0 + W, words);
    u32 cnt = 0;
    for (u32 w = w0; w < w1; ++w) cnt += __popc(bits[w]);
    u32 total;
    u32 c = block_exclusive_scan(cnt, sm.scan, &total);  // total == K
    (void)total;
    // ckey is dead since the bits were marked: it takes the K ids in order (K <= ncand
    // <= CAP), and the block writes them out row-wise.
    for (u32 w = w0; w < w1; ++w)
      for (u32 b = bits[w]; b != 0u; b &= b - 1u, ++c) sm.ckey[c] = w * 32u + (u32)(__ffs(b) - 1);
    __syncthreads();
    write_sorted_ids<MODE>([&](u32 c) { return sm.ckey[c]; }, src, K, out_ids, out_cols,
                           out_page, page_cols, slots);
    return TK_DONE;
  }
#endif
  for (u32 i = tid; i < ncand; i += TK_THREADS)
    if (taken(i)) sm.sel[atomicAdd(&sm.misc[3], 1u)] = sm.cid[i];
  __syncthreads();
  // Sort the K selected ids ascending (bitonic, padded to a power of two).
  u32 size = 1;
  while (size < K) size <<= 1;
  for (u32 i = K + tid; i < size; i += TK_THREADS) sm.sel[i] = 0xFFFFFFFFu;
  __syncthreads();
  for (u32 k2 = 2; k2 <= size; k2 <<= 1) {
    for (u32 j2 = k2 >> 1; j2 > 0; j2 >>= 1) {
      for (u32 i = tid; i < size; i += TK_THREADS) {
        const u32 l = i ^ j2;
        if (l > i) {
          const u32 a = sm.sel[i], b = sm.sel[l];
          const bool up = (i & k2) == 0;
          if ((a > b) == up) {
            sm.sel[i] = b;
            sm.sel[l] = a;
          }
        }
      }
      __syncthreads();
    }
  }
  write_sorted_ids<MODE>([&](u32 c) { return sm.sel[c]; }, src, K, out_ids, out_cols, out_page,
                         page_cols, slots);
  return TK_DONE;
}

// The shared-memory row's keys j0 .. j0 + 7 (a thread's run in the ordered pass), two
// 16-byte loads; for j0 < n, j0 + 8 <= ceil8(n) is inside buf. Keys at and past n are
// the caller's to zero.
__device__ __forceinline__ void buf_load8(u32 (&keys)[TK_ITEMS], const u32 *buf, const u32 j0) {
  const uint4 a = *reinterpret_cast<const uint4 *>(buf + j0);
  const uint4 b = *reinterpret_cast<const uint4 *>(buf + j0 + 4);
  keys[0] = a.x, keys[1] = a.y, keys[2] = a.z, keys[3] = a.w;
  keys[4] = b.x, keys[5] = b.y, keys[6] = b.z, keys[7] = b.w;
}

// ==== one row ====

// topk_row's fast paths over shared memory `fast` (skipped when `every`): true when they
// wrote the outputs (and counted the row's path); otherwise T, take_eq and path for the
// ordered pass, from the general path when the fast paths fall back. scan: fast's.
template <int MODE, int CL = 1, class Sm>
__device__ __forceinline__ bool topk_row_fast_paths(
    Sm &fast, const RowSrc &src, const u32 n, const u32 K, const bool every, i32 *out_ids,
    const u32 out_cols, i32 *out_page, const u32 page_cols, const SlotMap slots,
    u32 *paths, u32 &T, u32 &take_eq, int &path, u32 *&scan) {
  scan = fast.scan;
  if (every) return false;
  const int status = topk_row_fast<MODE, CL>(fast, src, n, K, out_ids, out_cols, out_page,
                                             page_cols, slots, &T, &take_eq, &path);
  if (CL > 1 && status == TK_HELPER) return true;
  if (status == TK_DONE) {
    if (paths != nullptr && threadIdx.x == 0) atomicAdd(&paths[path], 1u);
    return true;
  }
  if (status == TK_FALLBACK) {
    __syncthreads();
    const bool some = radix_select<true>(fast.h256, fast.misc, n, K,
                                         [&](u32 j) { return load_key<MODE>(src, j); }, T,
                                         take_eq);
    path = some ? TK_PATH_GENERAL : TK_PATH_ALL;
    if (!some) T = 0u;
  }
  return false;
}

// One row's selection. SHORT: buf is shared memory for the row's keys (capacity at
// least ceil8(n), 16-byte aligned), the shared-memory row path (a template parameter so
// that the other kernels carry none of its registers). WIDE: buf is dynamic shared memory
// of TK_WIDE_SMEM bytes (16-byte aligned) for the fast paths' TopkWideSmem. Else buf is
// null and the fast paths use a static TopkSmem. paths: null, or the launch's path
// counters (one count per row). CL > 1: a block of topk_cluster_f32's clusters of CL
// (sampled_candidates), WIDE.
template <int MODE, bool SHORT = false, bool WIDE = false, int CL = 1>
__device__ void topk_row(const RowSrc &src, const u32 n, const u32 K, i32 *out_ids,
                         const u32 out_cols, i32 *out_page, const u32 page_cols,
                         const SlotMap slots, u32 *buf, u32 *paths) {
  const int tid = threadIdx.x;
  // m = n <= K: every key is selected and no score is read (SPEC 5).
  const bool every = MODE != 1 && src.bitmap == nullptr && n <= K;
  // Threshold T; `take_eq` keys equal to T are taken, lowest j first. T = 0: every
  // candidate (m <= K, no score compared; no real K-th key is 0).
  u32 T = 0u, take_eq = 0u;
  // The shared-memory row's threshold selects exactly the keys >= T (no tie to break).
  bool ge = false;
  int path = TK_PATH_ALL;
  u32 *scan;
  u32 short_ids = 0;  // TK_SHORT_BITMAP: the ids short_bitmap_ids put in buf
  if constexpr (SHORT) {
    // Its own small static shared memory (the row takes the dynamic): three blocks per SM.
    __shared__ ShortSmem sm;
    scan = sm.scan;
    if (every) {
      buf = nullptr;
    } else if (short_row_threshold<MODE>(sm, buf, src, n, K, T, take_eq, ge)) {
      path = TK_PATH_SHORT;
      if (TK_SHORT_BITMAP && ge) short_ids = short_bitmap_ids(sm, buf, n, T);
    }
  } else {
    bool done;
    if constexpr (WIDE) {
      done = topk_row_fast_paths<MODE, CL>(*reinterpret_cast<TopkWideSmem *>(buf), src, n, K,
                                           every, out_ids, out_cols, out_page, page_cols,
                                           slots, paths, T, take_eq, path, scan);
    } else {
      __shared__ TopkSmem fast;
      done = topk_row_fast_paths<MODE>(fast, src, n, K, every, out_ids, out_cols, out_page,
                                       page_cols, slots, paths, T, take_eq, path, scan);
    }
    if (done) return;
  }
  if (paths != nullptr && tid == 0) atomicAdd(&paths[path], 1u);
  __syncthreads();
  const bool all = T == 0u;
  if (all) take_eq = 0u;

  u32 gt_before = 0, eq_before = 0;
  const u32 chunk = TK_THREADS * TK_ITEMS;
  // The shared-memory row stages its selected ids in buf (in place: output position
  // <= key index, and a chunk's keys are in registers before its writes) and copies them
  // out in order at the end, instead of one scattered 4-byte store per id.
  if (SHORT && ge && TK_SHORT_BITMAP) {
    gt_before = short_ids;  // short_bitmap_ids put them in buf
  } else if (SHORT && ge) {
    // Keys >= T, one compare per key; gt_before counts them.
    for (u32 base = 0; base < n; base += chunk) {
      const u32 j0 = base + tid * TK_ITEMS;
      u32 keys[TK_ITEMS];
      if (j0 < n) buf_load8(keys, buf, j0);
      u32 cnt = 0;
#pragma unroll
      for (int i = 0; i < TK_ITEMS; ++i) {
        if (j0 + i >= n) keys[i] = 0u;  // T > 0: never taken
        cnt += keys[i] >= T;
      }
      u32 tot;
      u32 g = gt_before + block_exclusive_scan(cnt, scan, &tot);
#pragma unroll
      for (int i = 0; i < TK_ITEMS; ++i)
        if (keys[i] >= T) buf[g++] = j0 + i;
      gt_before += tot;
    }
  } else
  for (u32 base = 0; base < n; base += chunk) {
    u32 keys[TK_ITEMS];
    u32 ngt = 0, neq = 0;
    if (SHORT && buf != nullptr) {
      const u32 j0 = base + tid * TK_ITEMS;
      if (j0 < n) buf_load8(keys, buf, j0);
#pragma unroll
      for (int i = 0; i < TK_ITEMS; ++i)
        if (j0 + i >= n) keys[i] = 0u;
#pragma unroll
      for (int i = 0; i < TK_ITEMS; ++i) {
        ngt += keys[i] > T;
        neq += (keys[i] == T && keys[i] != 0u);
      }
    } else {
#pragma unroll
      for (int i = 0; i < TK_ITEMS; ++i) {
        const u32 j = base + tid * TK_ITEMS + i;
        keys[i] = j < n ? (all && MODE == 0 && src.bitmap == nullptr ? 1u : load_key<MODE>(src, j))
                        : 0u;
        ngt += keys[i] > T;
        neq += (keys[i] == T && keys[i] != 0u);
      }
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
        if (SHORT && buf != nullptr) {
          buf[pos] = j;
        } else {
          const i32 id = out_id<MODE>(src, j);
          out_ids[pos] = id;
          if (out_page) out_page[pos] = slots.slot(id);
        }
      }
      g += is_gt;
      e += is_eq;
    }
    gt_before += tot >> 16;
    eq_before += tot & 0xFFFFu;
  }
  if (SHORT && buf != nullptr) {
    const u32 count = gt_before + min(eq_before, take_eq);
    __syncthreads();
    for (u32 c = tid; c < count; c += TK_THREADS) {
      const i32 id = out_id<MODE>(src, buf[c]);
      out_ids[c] = id;
      if (out_page) out_page[c] = slots.slot(id);
    }
  }
  const u32 count = gt_before + min(eq_before, take_eq);
  for (u32 c = count + tid; c < out_cols; c += TK_THREADS) out_ids[c] = -1;
  if (out_page)
    for (u32 c = count + tid; c < page_cols; c += TK_THREADS) out_page[c] = -1;
}

// ==== kernels ====

// Consumer row `row`'s kept blocks (its NB candidate ids in cblocks, -1 for none) as a
// bitmap over blocks in shared memory. Ends with a barrier.
__device__ __forceinline__ void consumer_bitmap(u32 *bitmap, const i32 *cblocks, u32 row,
                                                u32 num_blocks, u32 bitmap_words) {
  for (u32 i = threadIdx.x; i < bitmap_words; i += TK_THREADS) bitmap[i] = 0;
  __syncthreads();
  for (u32 i = threadIdx.x; i < num_blocks; i += TK_THREADS) {
    const i32 c = cblocks[(u64)row * num_blocks + i];
    if (c >= 0 && (u32)c < bitmap_words * 32u) atomicOr(&bitmap[c >> 5], 1u << (c & 31));
  }
  __syncthreads();
}

// Top-k of one tile's rows (row = row0 + blockIdx.x) over their f32 logits. The host
// splits a tile's rows by length: topk_short_f32 takes the rows of n <= row_cap keys,
// with the row's keys in shared memory; topk_ragged_f32 the rows of n >= n_min, with
// passes over global memory and more blocks per SM. A block whose row is the other
// launch's returns at once. Dynamic shared memory: a consumer row's bitmap of kept blocks
// (bitmap_words u32, when cblocks != null), then, for topk_short_f32, row_cap u32 (a
// multiple of 8) from the next multiple of 4 words.
template <bool SHORT, bool WIDE = false, int CL = 1>
__device__ __forceinline__ void topk_tile_row(
    const float *__restrict__ logits, const u64 *__restrict__ row_off,
    const u32 *__restrict__ row_n, const u32 *__restrict__ row_ks, u32 row0, u32 K,
    i32 *__restrict__ raw, i32 *__restrict__ page, u32 page_cols,
    const i32 *__restrict__ slot_table, u32 page_log2, const i32 *__restrict__ cblocks,
    u32 num_blocks, u32 block_size, u32 bitmap_words, u32 n_min, u32 row_cap,
    u32 *__restrict__ paths, u32 *smem) {
  const u32 row = row0 + (CL > 1 ? blockIdx.y : blockIdx.x);
  const u32 n = row_n[row];
  if (TK_STOP == 9 || (SHORT ? n > row_cap : n < n_min)) return;
  // A cluster's other blocks serve sampled rows only; the first selects any other alone.
  if (CL > 1 && cluster_rank() != 0u && !sampled_row<0>(n, K, TopkWideSmem::cap)) return;
  if (cblocks) consumer_bitmap(smem, cblocks, row, num_blocks, bitmap_words);
  const RowSrc src{logits + row_off[row], 0u, cblocks ? smem : nullptr, block_size, ~0u,
                   nullptr};
  u32 *buf = SHORT || WIDE ? smem + ((bitmap_words + 3u) & ~3u) : nullptr;
  topk_row<0, SHORT && TK_SHORT, WIDE, CL>(src, n, K, raw + (u64)row * K, K,
                                           page + (u64)row * page_cols, page_cols,
                                           SlotMap{slot_table, row_ks[row], page_log2}, buf,
                                           paths);
}

// block: row row0 + blockIdx.x if n >= n_min -> raw[row, 0:K], page[row, 0:page_cols]
extern "C" __global__ void __launch_bounds__(TK_THREADS, TK_RAGGED_MIN_BLOCKS) topk_ragged_f32(
    const float *__restrict__ logits, const u64 *__restrict__ row_off,
    const u32 *__restrict__ row_n, const u32 *__restrict__ row_ks, u32 row0, u32 K,
    i32 *__restrict__ raw, i32 *__restrict__ page, u32 page_cols,
    const i32 *__restrict__ slot_table, u32 page_log2, const i32 *__restrict__ cblocks,
    u32 num_blocks, u32 block_size, u32 bitmap_words, u32 n_min, u32 *__restrict__ paths) {
  extern __shared__ __align__(16) u32 dsmem[];
  topk_tile_row<false>(logits, row_off, row_n, row_ks, row0, K, raw, page, page_cols,
                       slot_table, page_log2, cblocks, num_blocks, block_size, bitmap_words,
                       n_min, 0u, paths, dsmem);
}

// topk_ragged_f32 for tiles of at most TK_WIDE_MIN_BLOCKS rows per SM: the fast paths'
// shared memory (TopkWideSmem, TK_WIDE_CAP candidates) is dynamic, after the consumer
// bitmap's words rounded up to a multiple of 4.
// block: row row0 + blockIdx.x if n >= n_min -> raw[row, 0:K], page[row, 0:page_cols]
extern "C" __global__ void __launch_bounds__(TK_THREADS, TK_WIDE_MIN_BLOCKS) topk_ragged_wide_f32(
    const float *__restrict__ logits, const u64 *__restrict__ row_off,
    const u32 *__restrict__ row_n, const u32 *__restrict__ row_ks, u32 row0, u32 K,
    i32 *__restrict__ raw, i32 *__restrict__ page, u32 page_cols,
    const i32 *__restrict__ slot_table, u32 page_log2, const i32 *__restrict__ cblocks,
    u32 num_blocks, u32 block_size, u32 bitmap_words, u32 n_min, u32 *__restrict__ paths) {
  extern __shared__ __align__(16) u32 dsmem[];
  topk_tile_row<false, true>(logits, row_off, row_n, row_ks, row0, K, raw, page, page_cols,
                             slot_table, page_log2, cblocks, num_blocks, block_size,
                             bitmap_words, n_min, 0u, paths, dsmem);
}

// topk_ragged_wide_f32 with a cluster of TK_CLUSTER blocks per row, for tiles of at most
// sms / TK_CLUSTER rows (kernels::topk_cluster): a sampled row's collecting pass is split
// across the cluster (sampled_candidates); any other row is the first block's alone.
// grid: (TK_CLUSTER, tile rows).
// block: row row0 + blockIdx.y -> raw[row, 0:K], page[row, 0:page_cols] (the first block)
extern "C" __global__ void __cluster_dims__(TK_CLUSTER, 1, 1) __launch_bounds__(TK_THREADS, 1)
    topk_cluster_f32(const float *__restrict__ logits, const u64 *__restrict__ row_off,
                     const u32 *__restrict__ row_n, const u32 *__restrict__ row_ks, u32 row0,
                     u32 K, i32 *__restrict__ raw, i32 *__restrict__ page, u32 page_cols,
                     const i32 *__restrict__ slot_table, u32 page_log2,
                     const i32 *__restrict__ cblocks, u32 num_blocks, u32 block_size,
                     u32 bitmap_words, u32 n_min, u32 *__restrict__ paths) {
  extern __shared__ __align__(16) u32 dsmem[];
  topk_tile_row<false, true, TK_CLUSTER>(logits, row_off, row_n, row_ks, row0, K, raw, page,
                                         page_cols, slot_table, page_log2, cblocks, num_blocks,
                                         block_size, bitmap_words, n_min, 0u, paths, dsmem);
}

// block: row row0 + blockIdx.x if n <= row_cap -> raw[row, 0:K], page[row, 0:page_cols]
extern "C" __global__ void __launch_bounds__(TK_THREADS) topk_short_f32(
    const float *__restrict__ logits, const u64 *__restrict__ row_off,
    const u32 *__restrict__ row_n, const u32 *__restrict__ row_ks, u32 row0, u32 K,
    i32 *__restrict__ raw, i32 *__restrict__ page, u32 page_cols,
    const i32 *__restrict__ slot_table, u32 page_log2, const i32 *__restrict__ cblocks,
    u32 num_blocks, u32 block_size, u32 bitmap_words, u32 row_cap, u32 *__restrict__ paths) {
  extern __shared__ __align__(16) u32 dsmem[];
  topk_tile_row<true>(logits, row_off, row_n, row_ks, row0, K, raw, page, page_cols,
                      slot_table, page_log2, cblocks, num_blocks, block_size, bitmap_words, 0u,
                      row_cap, paths, dsmem);
}

// Rows split across blocks (tiles with too few rows to fill the GPU): each of S blocks
// selects the K best of one segment of its row (ids sorted, -1 padded) into scratch
// [rows, S, K], then each id's ranking key (0 for -1) into [rows, S, K] after it; a merge
// block per row then selects the K best of those S*K ids. The row's K best (SPEC 5's
// total order) are each among their segment's K best, and a row's candidates lie in id
// order (segments in order, ids ascending in each), so the merge's lowest candidate
// index among tied keys is the lowest id: it returns exactly the row's selection.
// grid: (S, tile rows).
// block: segment blockIdx.x of row row0 + blockIdx.y -> scratch[blockIdx.y, blockIdx.x, 0:K]
// and their keys, the same index past rows * S * K
extern "C" __global__ void __launch_bounds__(TK_THREADS, TK_SEGMENTS_MIN_BLOCKS) topk_segments_f32(
    const float *__restrict__ logits, const u64 *__restrict__ row_off,
    const u32 *__restrict__ row_n, u32 row0, u32 K, i32 *__restrict__ scratch,
    const i32 *__restrict__ cblocks, u32 num_blocks, u32 block_size, u32 bitmap_words,
    u32 *__restrict__ paths) {
  extern __shared__ __align__(16) u32 dsmem[];
  u32 *bitmap = dsmem;
  const u32 row = row0 + blockIdx.y;
  const u32 n = row_n[row];
  if (cblocks) consumer_bitmap(bitmap, cblocks, row, num_blocks, bitmap_words);
  const u32 S = gridDim.x, seg = TK_SEG_ALIGN ? (((n + S - 1) / S + 3u) & ~3u) : (n + S - 1) / S;
  const u32 lo = min(n, blockIdx.x * seg), hi = min(n, lo + seg);
  const RowSrc src{logits + row_off[row], lo, cblocks ? bitmap : nullptr, block_size, ~0u,
                   nullptr};
  i32 *ids = scratch + ((u64)blockIdx.y * S + blockIdx.x) * K;
  topk_row<0>(src, hi - lo, K, ids, K, nullptr, 0, SlotMap{nullptr, 0u, 0u}, nullptr, paths);
  // The block's ids are visible to all its threads after the barrier; their keys follow.
  __syncthreads();
  u32 *keys = reinterpret_cast<u32 *>(ids + (u64)gridDim.y * S * K);
  const float *scores = logits + row_off[row];
  for (u32 c = threadIdx.x; c < K; c += TK_THREADS) {
    const i32 id = ids[c];
    keys[c] = id < 0 ? 0u : rank_key(scores[(u32)id]);
  }
}

// The merge of topk_segments_f32: grid (tile rows), S segments of K ids and their keys.
// block: scratch[blockIdx.x, 0:S, 0:K] of row row0 + blockIdx.x, and their keys rows * S * K
// past them -> raw[row, 0:K], page[row, :]
extern "C" __global__ void __launch_bounds__(TK_THREADS) topk_merge_f32(
    const u32 *__restrict__ row_ks, u32 row0, u32 K, u32 S, const i32 *__restrict__ scratch,
    i32 *__restrict__ raw, i32 *__restrict__ page, u32 page_cols,
    const i32 *__restrict__ slot_table, u32 page_log2, u32 *__restrict__ paths) {
  const u32 row = row0 + blockIdx.x;
  const i32 *ids = scratch + (u64)blockIdx.x * S * K;
  const RowSrc src{ids + (u64)gridDim.x * S * K, 0u, nullptr, 1u, ~0u, ids};
  topk_row<2>(src, S * K, K, raw + (u64)row * K, K, page + (u64)row * page_cols, page_cols,
              SlotMap{slot_table, row_ks[row], page_log2}, nullptr, paths);
}

// Block keys of the tile's publishing rows: max ranking key over each block of B keys.
// grid: (row blocks, tile rows).
// block: row row0 + blockIdx.y's blocks c = blockIdx.x * blockDim.x + threadIdx.x, + the
// grid's threads -> bkeys[row_boff[row] + c]
extern "C" __global__ void __launch_bounds__(BK_THREADS) block_keys_f32(
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
// block: publishing row row0 + blockIdx.x -> published[row_pub[row], 0:NB]
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
  const RowSrc src{bkeys + row_boff[row], 0u, nullptr, 1u, nb > 0 ? nb - 1 : ~0u, nullptr};
  topk_row<1>(src, nb, k > 0 ? k : 1u, published + (u64)p * num_blocks, num_blocks, nullptr, 0,
              SlotMap{nullptr, 0u, 0u}, nullptr, nullptr);
}

// Decode rows (SPEC 10) from the device's context lengths, for launches whose shapes
// depend on host scalars only (src/cuda/decode.rs): request b = i / next_n has
// S_b = context_lens[b] tokens and rows at positions S_b - next_n + t (t < next_n), each
// seeing n = (p + 1) / ratio keys, cut to max_keys (0 at negative positions); its
// page-table row starts at entry b * table_cols, its logits at i * stride floats. Row
// groups of at most lg_rows rows of one request: (first row, rows, keys of its last row,
// 0). Thread i also zeroes path counter i (i < npaths).
extern "C" __global__ void decode_rows(const i32 *__restrict__ context_lens, u32 B, u32 next_n,
                                       u32 ratio, u32 max_keys, u32 table_cols, u32 stride,
                                       u32 lg_rows, u32 *__restrict__ row_n,
                                       u32 *__restrict__ row_ks, u64 *__restrict__ row_off,
                                       uint4 *__restrict__ groups, u32 *__restrict__ paths,
                                       u32 npaths) {
  const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
  const u32 gpr = (next_n + lg_rows - 1) / lg_rows;
  auto visible = [&](u32 b, u32 t) -> u32 {
    const long long p = (long long)context_lens[b] - (long long)next_n + (long long)t;
    if (p < 0) return 0u;
    return (u32)min((unsigned long long)(p + 1) / ratio, (unsigned long long)max_keys);
  };
  if (i < npaths) paths[i] = 0u;
  if (i < B * next_n) {
    const u32 b = i / next_n, t = i % next_n;
    row_n[i] = visible(b, t);
    row_ks[i] = b * table_cols;
    row_off[i] = (u64)i * stride;
  }
  if (i < B * gpr) {
    const u32 b = i / gpr, r0 = (i % gpr) * lg_rows;
    const u32 rows = min(lg_rows, next_n - r0);
    groups[i] = make_uint4(b * next_n + r0, rows, visible(b, r0 + rows - 1), 0u);
  }
}

// Device codec check: decode every code of each format (SPEC 2).
// out: [256] e4m3 as f32 bits, [16] e2m1 (e4m3 bytes of twice the value, and of the
// value), [256] ue8m0.
extern "C" __global__ void decode_codes(u32 *out_e4m3, u32 *out_e2m1_doubled,
                                        u32 *out_e2m1_e4m3, u32 *out_ue8m0) {
  const u32 i = threadIdx.x;
  if (i < 256) {
    out_e4m3[i] = __float_as_uint(e4m3_decode(i));
    out_ue8m0[i] = __float_as_uint(ue8m0_pow2(i, 0));
  }
  if (i < 16) {
    out_e2m1_doubled[i] = e2m1_doubled_e4m3(i);
    out_e2m1_e4m3[i] = e2m1_e4m3(i);
  }
}
