// validate: SPEC 8's value checks of inputs that are already on the device (the engine
// API), one coalesced pass before any logits run.
// block: segment blockIdx.y, 16-byte chunks (grid-stride over x) -> *first = the least
//        (segment << 56 | flat element index) of an offending element, if any.
//
// The host passes the segments in Problem::new's order of checks (q or q_scale, k,
// k_scale, weights, k_slots) and only non-empty ones, so the least key is the error
// Problem::new reports for the same host arrays. It initialises *first to ~0 and reads
// it back once; the offending value itself it copies back only when there is one.
//
// The host prepends VAL_SEGS (segments per launch) and VAL_THREADS (block size).

static_assert(VAL_SEGS >= 1 && VAL_SEGS <= 255, "the segment index fits the key's top byte");
static_assert(VAL_THREADS % 32 == 0 && VAL_THREADS <= 1024, "block size");

// What a segment's elements must be.
#define VAL_E4M3 0u      // u8, not 0x7F / 0xFF (the E4M3 NaN codes)
#define VAL_UE8M0 1u     // u8, not 255 (reserved)
#define VAL_POSITIVE 2u  // f32, finite and > 0 (per-key scales)
#define VAL_FINITE 3u    // f32, finite (weights)
#define VAL_NONNEG 4u    // i32, >= 0 (pool slots)

// Flat element indices are below 2^56 (the host checks T, L < 2^31; H * D <= 8192).
#define VAL_INDEX_BITS 56

// One tensor: its device address (a multiple of its element size: the host checks),
// its length in elements, and its kind. 24 bytes, as the host's #[repr(C)] twin.
struct ValSeg {
  u64 ptr;
  u64 len;
  u32 kind;
  u32 pad;
};
struct ValSegs {
  ValSeg s[VAL_SEGS];
};
static_assert(sizeof(ValSeg) == 24, "layout shared with the host");

// Offending bytes of the word x as bit 7 of each byte lane (little-endian: lane 0 is
// the lowest address). (b & 0x7F) + 1 sets bit 7 exactly when b's low seven bits are
// all ones, and never carries into the next lane (at most 0x80).
__device__ __forceinline__ u32 bad_bytes(u32 x, u32 kind) {
  const u32 low7_ones = (x & 0x7F7F7F7Fu) + 0x01010101u;
  return kind == VAL_E4M3 ? (low7_ones & 0x80808080u)       // 0x7F or 0xFF
                          : (low7_ones & x & 0x80808080u);  // 0xFF
}

// Whether the 4-byte element x offends (bit tests: no float compare, no FTZ question).
__device__ __forceinline__ bool bad_word(u32 x, u32 kind) {
  if (kind == VAL_POSITIVE) return x - 1u >= 0x7F7FFFFFu;  // +0, sign set, inf or NaN
  if (kind == VAL_FINITE) return (x & 0x7F800000u) == 0x7F800000u;  // inf or NaN
  return (x >> 31) != 0u;                                          // negative i32
}

// Byte offset (0..3) in the word x of its first offending element, or 4 for none.
__device__ __forceinline__ u32 first_bad(u32 x, u32 kind) {
  if (kind <= VAL_UE8M0) {
    const u32 m = bad_bytes(x, kind);
    return m ? (u32)(__ffs(m) - 1) >> 3 : 4u;
  }
  return bad_word(x, kind) ? 0u : 4u;
}

// Whether the one element at p (esize bytes: 1 or 4, p aligned to it) offends.
__device__ __forceinline__ bool bad_element(const u8 *p, u64 esize, u32 kind) {
  if (esize == 1) return (bad_bytes((u32)__ldg(p), kind) & 0x80u) != 0u;
  return bad_word(__ldg(reinterpret_cast<const u32 *>(p)), kind);
}

extern "C" __global__ void __launch_bounds__(VAL_THREADS)
    validate_inputs(const __grid_constant__ ValSegs segs, u64 *__restrict__ first) {
  // __grid_constant__: indexed in the parameter space, not copied to local memory.
  const ValSeg sg = segs.s[blockIdx.y];
  if (sg.len == 0) return;
  const u32 kind = sg.kind;
  const u64 esize = kind <= VAL_UE8M0 ? 1u : 4u;
  const u8 *base = reinterpret_cast<const u8 *>(sg.ptr);
  const u64 bytes = sg.len * esize;
  // Head: bytes before the first 16-byte boundary; body: whole 16-byte chunks; tail:
  // the rest. Head and tail hold fewer than 16 bytes, whole elements (ptr % esize == 0).
  u64 head = (16u - (sg.ptr & 15u)) & 15u;
  if (head > bytes) head = bytes;
  const u64 chunks = (bytes - head) >> 4;
  const u64 tail = head + (chunks << 4);
  const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  const u64 stride = (u64)gridDim.x * blockDim.x;
  // This thread's least offending byte offset. Head offsets precede body offsets,
  // which precede tail offsets, and a thread's body chunks ascend: the first hit is
  // its least, so it stops there.
  u64 found = ~0ull;
  if (tid < head / esize && bad_element(base + tid * esize, esize, kind)) found = tid * esize;
  if (found == ~0ull) {
    const uint4 *body = reinterpret_cast<const uint4 *>(base + head);
    for (u64 c = tid; c < chunks; c += stride) {
      const uint4 v = __ldg(body + c);
      const u32 w[4] = {v.x, v.y, v.z, v.w};
      u32 hit = 16u;
#pragma unroll
      for (int i = 3; i >= 0; --i) {
        const u32 b = first_bad(w[i], kind);
        if (b < 4u) hit = 4u * (u32)i + b;
      }
      if (hit < 16u) {
        found = head + (c << 4) + hit;
        break;
      }
    }
  }
  if (found == ~0ull && tid < (bytes - tail) / esize &&
      bad_element(base + tail + tid * esize, esize, kind))
    found = tail + tid * esize;
  if (found != ~0ull) {
    const unsigned long long key =
        ((unsigned long long)blockIdx.y << VAL_INDEX_BITS) | (found / esize);
    atomicMin(reinterpret_cast<unsigned long long *>(first), key);
  }
}

// ==== paged keys (SPEC 10) ====
//
// SPEC 8 over paged keys checks what some request reads and nothing else, in
// Problem::new's order: the used page-table entries first (request b's entries
// e < ceil(L_b / P)), then the slots read, page by page and slot by slot (a page's slots
// 0 .. used[page] - 1, used[page] = the most any reader reads of it), the codes before
// the scale. Two launches: validate_page_ids, then validate_slots, which reads what the
// first wrote to `used` (zeros from the host). first[0] and first[1] start at ~0.

// thread: page-table entry x = b * cols + e of the grid-stride -> first[0] = the least
// bad x (an id outside [0, num_pages)); used[id] = max(used[id], slots read of it).
extern "C" __global__ void __launch_bounds__(VAL_THREADS)
    validate_page_ids(const i32 *__restrict__ page_table, u32 cols, u32 requests,
                      const u32 *__restrict__ req_keys, u32 page_log2, u32 num_pages,
                      u32 *__restrict__ used, u64 *__restrict__ first) {
  const u64 n = (u64)requests * cols;
  const u32 p = 1u << page_log2;
  for (u64 x = (u64)blockIdx.x * blockDim.x + threadIdx.x; x < n;
       x += (u64)gridDim.x * blockDim.x) {
    const u32 b = (u32)(x / cols), e = (u32)(x % cols);
    const u32 keys = req_keys[b];
    if (e >= (keys + p - 1) >> page_log2) continue;  // an unused entry: not read
    const i32 id = page_table[x];
    if (id < 0 || (u32)id >= num_pages) {
      atomicMin(reinterpret_cast<unsigned long long *>(first), (unsigned long long)x);
      continue;
    }
    atomicMax(&used[id], min(keys - (e << page_log2), p));
  }
}

// thread: pool slot s = page * P + t of the grid-stride, if t < used[page] -> first[1] =
// the least s * (W + 1) + position of a bad value: E4M3 keys (W = D), position d < D for
// a NaN code, D for a scale that is not finite and > 0; E2M1 keys (W = G), position g for
// a UE8M0 255.
extern "C" __global__ void __launch_bounds__(VAL_THREADS)
    validate_slots(const u8 *__restrict__ pool, u32 page_log2, u32 num_pages, u32 e2m1,
                   u32 dim, const u32 *__restrict__ used, u64 *__restrict__ first) {
  const u32 p = 1u << page_log2;
  const u32 g = dim / 32;
  const u32 cw = e2m1 ? dim / 2 : dim;  // code bytes per token
  const u32 sw = e2m1 ? g : 4u;         // scale bytes per token
  const u64 page_bytes = (u64)(cw + sw) << page_log2;
  const u64 w = e2m1 ? g : dim;
  const u64 n = (u64)num_pages << page_log2;
  for (u64 s = (u64)blockIdx.x * blockDim.x + threadIdx.x; s < n;
       s += (u64)gridDim.x * blockDim.x) {
    const u64 page = s >> page_log2;
    const u32 t = (u32)(s & (p - 1));
    if (t >= used[page]) continue;
    const u8 *base = pool + page * page_bytes;
    u64 pos = ~0ull;
    if (e2m1) {
      const u8 *sc = base + ((u64)cw << page_log2) + (u64)t * g;
      for (u32 i = 0; i < g && pos == ~0ull; ++i)
        if (sc[i] == 0xFFu) pos = i;
    } else {
      const u32 *codes = reinterpret_cast<const u32 *>(base + (u64)t * dim);
      for (u32 i = 0; i < dim / 4 && pos == ~0ull; ++i) {
        const u32 m = bad_bytes(__ldg(codes + i), VAL_E4M3);
        if (m) pos = 4u * i + ((u32)(__ffs(m) - 1) >> 3);
      }
      const u32 sc = __ldg(reinterpret_cast<const u32 *>(base + ((u64)dim << page_log2) + 4u * t));
      if (pos == ~0ull && bad_word(sc, VAL_POSITIVE)) pos = dim;
    }
    if (pos != ~0ull)
      atomicMin(reinterpret_cast<unsigned long long *>(first) + 1,
                (unsigned long long)(s * (w + 1) + pos));
  }
}
