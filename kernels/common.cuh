// common.cuh: types, codecs, ranking key and inline-PTX tensor-core helpers shared by
// every kernel. NVRTC compiles it with no CUDA toolkit headers: everything here is
// built-in or inline PTX. The host prepends it (and the variant's #defines) to each
// kernel source; kernels do not #include it.
//
// Arithmetic rule (SPEC 4): every f32 step is one IEEE binary32 operation, written
// with __fmul_rn / __fadd_rn, compiled with --fmad=false and no flush to zero.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef int i32;
typedef unsigned long long u64;
typedef long long i64;

#define FULL_MASK 0xffffffffu

// ==== codecs (SPEC 2) ====

// E4M3 byte of the E2M1 magnitude of index 0..7: {0, .5, 1, 1.5, 2, 3, 4, 6}.
#define E2M1_AS_E4M3 0x4C4844403C383000ull

// E4M3 byte of twice the E2M1 magnitude of index 0..7: {0, 1, 2, 3, 4, 6, 8, 12}, exact.
#define E2M1_DOUBLED_AS_E4M3 0x54504C4844403800ull

// E2M1 code -> the E4M3 byte of twice its value (exact; -0 -> 0x80).
__device__ __forceinline__ u32 e2m1_doubled_e4m3(u32 c) {
  u32 b = (u32)((E2M1_DOUBLED_AS_E4M3 >> ((c & 7u) * 8u)) & 0xFFu);
  return b | ((c & 8u) << 4);
}

// E2M1 code -> the E4M3 byte of the same value (exact; -0 -> 0x80).
__device__ __forceinline__ u32 e2m1_e4m3(u32 c) {
  u32 b = (u32)((E2M1_AS_E4M3 >> ((c & 7u) * 8u)) & 0xFFu);
  return b | ((c & 8u) << 4);
}

// Four packed bytes (8 codes) -> 8 bytes as two u32 (low element first), each the table
// byte of the code's magnitude (t0: magnitudes 0..3, t1: 4..7; bit 7 free) with the
// code's sign in bit 7. Nibble k of w is element k, so one byte permute looks up four
// magnitudes at once (PRMT uses the low 3 bits of each selector nibble: the magnitude
// index) and a second one turns each sign bit into 0x00 / 0x80: five ops per four codes.
__device__ __forceinline__ void e2m1_word_tab(u32 w, u32 t0, u32 t1, u32 &lo, u32 &hi) {
  lo = __byte_perm(t0, t1, w) | __byte_perm(0x00008000u, 0u, (w >> 3) & 0x1111u);
  hi = __byte_perm(t0, t1, w >> 16) | __byte_perm(0x00008000u, 0u, (w >> 19) & 0x1111u);
}

// Four packed bytes (8 codes) -> 8 s8 bytes as two u32 (low element first): twice each
// code's value times 2^s, s in 0..3 (magnitudes {0, 1, 2, 3, 4, 6, 8, 12} << s, at most
// 96; -0 -> 0). p0, p1 hold the shifted magnitudes (a u32 shift moves no bit across a
// byte: each is below 16 before it), n0, n1 their negations, bytewise (0x80 - m) ^ 0x80
// with no borrow since m <= 0x80; one byte permute looks up each table (low 3 bits of
// each selector nibble, as in e2m1_word_tab), a third picks the negative byte (selector
// n + 4) where the code's sign is set.
__device__ __forceinline__ void e2m1_word_s8(u32 w, int s, u32 &lo, u32 &hi) {
  const u32 p0 = 0x03020100u << s, p1 = 0x0C080604u << s;
  const u32 n0 = (0x80808080u - p0) ^ 0x80808080u, n1 = (0x80808080u - p1) ^ 0x80808080u;
  const u32 wh = w >> 16;
  lo = __byte_perm(__byte_perm(p0, p1, w), __byte_perm(n0, n1, w), 0x3210u | ((w >> 1) & 0x4444u));
  hi = __byte_perm(__byte_perm(p0, p1, wh), __byte_perm(n0, n1, wh),
                   0x3210u | ((wh >> 1) & 0x4444u));
}

// The E4M3 bytes of the codes' values (the table of E2M1_AS_E4M3).
__device__ __forceinline__ void e2m1_word(u32 w, u32 &lo, u32 &hi) {
  e2m1_word_tab(w, 0x3C383000u, 0x4C484440u, lo, hi);
}

// UE8M0 byte e -> 2^(e - 127 - extra) as an f32, exact for results >= 2^-149
// (e = 0 with extra = 0 is 2^-127, bits 0x00400000, as SPEC 2 says).
__device__ __forceinline__ float ue8m0_pow2(u32 e, int extra) {
  int x = (int)e - extra;  // biased exponent of the result
  if (x >= 1) return __uint_as_float(((u32)x) << 23);
  int sh = 22 + x;  // subnormal: 2^(x - 127) = 2^-149 * 2^(x + 22)
  return sh >= 0 ? __uint_as_float(1u << sh) : 0.0f;
}

// 2^e as an f32 for e in [-149, 127] (exact); callers check the range.
__device__ __forceinline__ float pow2i(int e) {
  return e >= -126 ? __uint_as_float((u32)(e + 127) << 23) : __uint_as_float(1u << (e + 149));
}

// The E4M3 byte of m * 2^s for m in {0, 1, 2, 3, 4, 6, 8, 12} and s in [-9, 5]: every
// such value is exact in E4M3 (12 * 2^5 = 384 <= 448; 1 * 2^-9 is its least subnormal).
__device__ __forceinline__ u32 e4m3_exact_byte(u32 m, int s) {
  if (m == 0) return 0u;
  const int p = 31 - __clz(m);  // m = 1.f * 2^p
  const int e = p + s;           // unbiased exponent of the value
  if (e >= -6) return ((u32)(e + 7) << 3) | (((m << 3) >> p) & 7u);
  return m << (s + 9);  // subnormal: m * 2^s = (m * 2^(s+9)) * 2^-9
}

// Decoded E4M3 byte (for the device codec test): exact in f32.
__device__ __forceinline__ float e4m3_decode(u32 b) {
  u32 e = (b >> 3) & 0xFu, m = b & 7u;
  if (e == 0xFu && m == 7u) return __uint_as_float(0x7fc00000u);
  float v = e == 0 ? __fmul_rn((float)m, 0.001953125f)               // m * 2^-9
                   : __fmul_rn((float)(8u + m), ue8m0_pow2(e + 117u, 0));  // (8+m) 2^(e-10)
  return (b & 0x80u) ? -v : v;
}

// ==== SPEC 5 ranking key ====

// Order-preserving key: NaN as -inf, -0.0 as +0.0, larger = better. Never 0: the
// smallest key (-inf) is 0x007FFFFF, so 0 is free for "not a candidate".
__device__ __forceinline__ u32 rank_key(float x) {
  // x + (+0) is x in round to nearest, except -0 + +0 = +0: one add ranks -0 as +0 (no
  // flush to zero: subnormals pass unchanged). Then NaN as -inf, and the sign flip as
  // one xor with (sign mask | 0x80000000): negatives invert, positives gain the top bit.
  // Five instructions (a compare-and-select form takes seven).
  const float y = __fadd_rn(x, 0.0f);
  const u32 b = y != y ? 0xFF800000u : __float_as_uint(y);
  return b ^ ((u32)((int)b >> 31) | 0x80000000u);
}

// SPEC 4's relu(x) = x > 0 ? x : +0.0 (NaN -> +0.0) as one max.f32: the PTX ISA defines
// max.f32 without .NaN as "NaN operand -> the other operand, else (x > y) ? x : y, with
// +0.0 > -0.0", so max(x, +0.0) is SPEC 4's relu for every x: NaN -> +0, -0 -> +0.
__device__ __forceinline__ float relu_f32(float x) { return fmaxf(x, 0.0f); }

// ==== tensor cores ====

// D = A(16x32 e4m3, row) * B(32x8 e4m3, col) + C, f32 accumulate.
__device__ __forceinline__ void mma_e4m3(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// D = A * B with a zero accumulator (one zero register for all of C).
__device__ __forceinline__ void mma_e4m3_zero(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%10,%10,%10,%10};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.0f));
}

// D = A(16x16 f16, row) * B(16x8 f16, col) + C, f32 accumulate: the native Hopper
// mma.sync (e4m3 mma.sync is emulated on sm_90: F2FP unpacks to f16, then this).
__device__ __forceinline__ void mma_f16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_f16_zero(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%10,%10,%10,%10};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.0f));
}

// The high byte of the f16 of m * 2^s, m in {0, 1, 2, 3, 4, 6, 8, 12}, s in [-9, 5]: all
// normal f16 with at most one fraction bit, so the low byte is 0 (and 0 -> 0).
__device__ __forceinline__ u32 f16_exact_hi_byte(u32 m, int s) {
  if (m == 0) return 0u;
  const int p = 31 - __clz(m);  // m = 1.f * 2^p, f in {0, .5}
  return ((u32)(p + s + 15) << 2) | ((((m << 1) >> p) & 1u) << 1);
}

// Two codes (c0 in bits 0-3, c1 in bits 4-7) -> their f16 pair (c0 low), from a table of
// f16 high bytes (t0: magnitudes 0..3, t1: 4..7; byte 0 of t0 is 0).
__device__ __forceinline__ u32 e2m1_pair_f16(u32 b, u32 t0, u32 t1) {
  const u32 sel = ((b & 7u) << 4) | ((b & 0x70u) << 8);  // bytes [0, T[c0], 0, T[c1]]
  return __byte_perm(t0, t1, sel) | ((b & 8u) << 12) | ((b & 0x80u) << 24);
}

// The shared-state-space address of a pointer into shared memory.
__device__ __forceinline__ u32 smem_u32(const void *p) { return (u32)__cvta_generic_to_shared(p); }

// Four 8x8 b16 matrices from shared memory; lane l gives the address of row (l & 7) of
// matrix (l >> 3).
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const void *smem) {
  const u32 addr = smem_u32(smem);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// 16-byte global -> shared copy, bypassing registers; bytes past src_bytes (0 or 16)
// are zero-filled.
__device__ __forceinline__ void cp_async16(void *smem, const void *gmem, u32 src_bytes) {
  const u32 addr = smem_u32(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(gmem),
               "r"(src_bytes));
}
// 4-byte variant.
__device__ __forceinline__ void cp_async4(void *smem, const void *gmem, u32 src_bytes) {
  const u32 addr = smem_u32(smem);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(addr), "l"(gmem),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ==== Hopper warpgroup MMA (wgmma) ====

// Shared-memory matrix descriptor, no swizzle: start address, LBO (bytes between core
// matrices adjacent in K) and SBO (adjacent in M or N); a core matrix is 8 rows of 16
// contiguous bytes.
__device__ __forceinline__ u64 wgmma_desc(const void *smem, u32 lbo, u32 sbo) {
  const u32 a = smem_u32(smem);
  return (u64)((a & 0x3FFFFu) >> 4) | ((u64)((lbo & 0x3FFFFu) >> 4) << 16) |
         ((u64)((sbo & 0x3FFFFu) >> 4) << 32);
}
// Shared-memory matrix descriptor, 128-byte swizzle, K-major: rows of 128 bytes, 8-row
// groups 1024 bytes apart (SBO), the 16-byte chunk c of row r stored at chunk c ^ (r & 7)
// of the row (the pattern TMA writes), taken on the address bits, so the operand's
// 1024-byte atoms are 1024-byte aligned. A k-step that starts b bytes into the rows
// (b < 128) is the descriptor of smem + b. LBO is unused in this mode (1 by custom).
// The same for rows of 64 bytes (64-byte swizzle: 8-row groups 512 bytes apart, chunk c of
// row r at chunk c ^ ((r >> 1) & 3), 512-byte aligned atoms), or 128 (the above): K-major
// rows of `row_bytes` bytes as TMA writes them with the swizzle of that width.
__device__ __forceinline__ u64 wgmma_desc_swz(const void *smem, const u32 row_bytes) {
  const u32 a = smem_u32(smem);
  return (u64)((a & 0x3FFFFu) >> 4) | ((u64)1 << 16) | ((u64)((8 * row_bytes) >> 4) << 32) |
         ((u64)(row_bytes == 128 ? 1 : 2) << 62);
}
__device__ __forceinline__ u64 wgmma_desc_sw128(const void *smem) {
  return wgmma_desc_swz(smem, 128);
}
// Descriptor d with its start address advanced by `bytes` (a multiple of 16): the address
// field is the low 14 bits of address >> 4 and no shared address reaches 2^18, so adding
// bytes >> 4 to the low word steps it exactly.
__device__ __forceinline__ u64 wgmma_desc_add(const u64 d, const u32 bytes) {
  return (d & 0xFFFFFFFF00000000ull) | (u64)((u32)d + (bytes >> 4));
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Generic-proxy shared-memory writes made visible to the tensor cores' async proxy.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Keeps the compiler from touching accumulator registers across the async MMA.
template <int N>
__device__ __forceinline__ void fence_regs(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// D = A(64x32 e4m3, smem, K-major) * B(32x64 e4m3, smem, K-major), D overwritten
// (scale-d = 0). Thread t of the warpgroup holds rows 16(t/32) + (t%32)/4 (+8) and
// columns 8j + 2(t%4) (+1): d[4j + 2*(row half) + col].
__device__ __forceinline__ void wgmma_m64n64k32_e4m3(float (&d)[32], u64 da, u64 db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(da), "l"(db), "r"(0));
}

// D = A(64x32 e4m3, registers: the mma.sync m16n8k32 A fragment of each warp's 16 rows)
// * B(32x64 e4m3, smem, K-major), D overwritten (scale-d = 0). Layout of D as in
// wgmma_m64n64k32_e4m3.
__device__ __forceinline__ void wgmma_m64n64k32_e4m3_rs(float (&d)[32], const u32 (&a)[4], u64 db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(0));
}
// Pins MMA A fragments: computed before this point (an empty asm that reads and writes
// each register; volatile asms keep their order, so the fragments are ready before a
// later wgmma fence).
template <int N>
__device__ __forceinline__ void fence_regs_a(u32 (&a)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(a[i][j])::"memory");
}
// Keeps the compiler from touching integer accumulator registers across the async MMA.
template <int N>
__device__ __forceinline__ void fence_regs_s32(int (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(d[i])::"memory");
}
// D (+)= A(64x32 s8, registers) * B(32x64 s8, smem, K-major), s32 accumulate, exact (no
// saturation: .satfinite not given, and the callers' sums stay far inside i32); scale_d
// = 0 overwrites D. The s8 A fragment and the s32 accumulator have the layouts of the
// e4m3 ones (wgmma_m64n64k32_e4m3_rs; CUTLASS's ALayout_64x32 and CLayout_64x64 serve
// both types).
__device__ __forceinline__ void wgmma_m64n64k32_s8_rs(int (&d)[32], const u32 (&a)[4], u64 db,
                                                      u32 scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p;\n}\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]), "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]), "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]), "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
}
// D (+)= A(64x32 s8, registers) * B(32x128 s8, smem, K-major), s32 accumulate, exact as
// wgmma_m64n64k32_s8_rs; accumulator layout as in wgmma_m64n64k32_e4m3 with j = 0..15.
__device__ __forceinline__ void wgmma_m64n128k32_s8_rs(int (&d)[64], const u32 (&a)[4], u64 db,
                                                       u32 scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p;\n}\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]), "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]), "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]), "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31]), "+r"(d[32]), "+r"(d[33]), "+r"(d[34]), "+r"(d[35]), "+r"(d[36]), "+r"(d[37]), "+r"(d[38]), "+r"(d[39]), "+r"(d[40]), "+r"(d[41]), "+r"(d[42]), "+r"(d[43]), "+r"(d[44]), "+r"(d[45]), "+r"(d[46]), "+r"(d[47]), "+r"(d[48]), "+r"(d[49]), "+r"(d[50]), "+r"(d[51]), "+r"(d[52]), "+r"(d[53]), "+r"(d[54]), "+r"(d[55]), "+r"(d[56]), "+r"(d[57]), "+r"(d[58]), "+r"(d[59]), "+r"(d[60]), "+r"(d[61]), "+r"(d[62]), "+r"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
}
// D (+)= A(64x32 s8, smem descriptor) * B(32x128 s8, smem descriptor), s32 accumulate,
// exact as wgmma_m64n128k32_s8_rs; scale_d = 0 overwrites D. Accumulator layout as there.
__device__ __forceinline__ void wgmma_m64n128k32_s8_ss(int (&d)[64], u64 da, u64 db, u32 scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p;\n}\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]), "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]), "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]), "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31]), "+r"(d[32]), "+r"(d[33]), "+r"(d[34]), "+r"(d[35]), "+r"(d[36]), "+r"(d[37]), "+r"(d[38]), "+r"(d[39]), "+r"(d[40]), "+r"(d[41]), "+r"(d[42]), "+r"(d[43]), "+r"(d[44]), "+r"(d[45]), "+r"(d[46]), "+r"(d[47]), "+r"(d[48]), "+r"(d[49]), "+r"(d[50]), "+r"(d[51]), "+r"(d[52]), "+r"(d[53]), "+r"(d[54]), "+r"(d[55]), "+r"(d[56]), "+r"(d[57]), "+r"(d[58]), "+r"(d[59]), "+r"(d[60]), "+r"(d[61]), "+r"(d[62]), "+r"(d[63])
      : "l"(da), "l"(db), "r"(scale_d));
}
// D (+)= A(64x32 e4m3, registers: the mma.sync m16n8k32 A fragment of each warp's 16
// rows) * B(32x128 e4m3, smem, K-major); scale_d = 0 overwrites D. Accumulator layout as
// in wgmma_m64n64k32_e4m3, with j = 0..15. The tensor core adds the products with
// about 13 bits kept (a probe on the H200): the tolerance class's fp8 path only.
__device__ __forceinline__ void wgmma_m64n128k32_e4m3_rs(float (&d)[64], const u32 (&a)[4], u64 db,
                                                         u32 scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
}
// D (+)= A(64x32 e4m3, smem descriptor) * B(32x128 e4m3, smem descriptor); scale_d = 0
// overwrites D. Accumulator layout as in wgmma_m64n128k32_e4m3_rs.
__device__ __forceinline__ void wgmma_m64n128k32_e4m3_ss(float (&d)[64], u64 da, u64 db,
                                                         u32 scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(da), "l"(db), "r"(scale_d));
}
// D (+)= A(64x16 f16, registers: the mma.sync m16n8k16 A fragment of each warp's 16
// rows) * B(16x128 f16, smem, K-major); scale_d = 0 overwrites D. Accumulator layout as
// in wgmma_m64n64k32_e4m3, with j = 0..15.
__device__ __forceinline__ void wgmma_m64n128k16_f16_rs(float (&d)[64], const u32 (&a)[4], u64 db,
                                                        u32 scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
}

// Two E4M3 bytes (bits 0-7: element 0, bits 8-15: element 1) -> their f16 pair, exact
// (every E4M3 value is an f16). One F2FP per pair on sm_90.
__device__ __forceinline__ u32 e4m3x2_f16x2(u32 b) {
  u32 r;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(r) : "h"((unsigned short)(b & 0xFFFFu)));
  return r;
}

// ==== block-wide helpers ====

// Exclusive prefix sum of v over the block (blockDim.x a multiple of 32, <= 1024);
// *total receives the block sum. `scratch` holds 33 u32. Ends with a barrier.
__device__ __forceinline__ u32 block_exclusive_scan(u32 v, u32 *scratch, u32 *total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  u32 x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    u32 y = __shfl_up_sync(FULL_MASK, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) scratch[warp] = x;
  __syncthreads();
  if (warp == 0) {
    u32 s = lane < nw ? scratch[lane] : 0u;
    u32 t = s;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      u32 y = __shfl_up_sync(FULL_MASK, t, o);
      if (lane >= o) t += y;
    }
    scratch[lane] = t - s;  // exclusive
    if (lane == 31) scratch[32] = t;
  }
  __syncthreads();
  u32 r = scratch[warp] + x - v;
  *total = scratch[32];
  __syncthreads();
  return r;
}

// ==== Hopper bulk tensor copies (TMA) and transaction barriers ====

// A CUtensorMap (the host encodes it: cuTensorMapEncodeTiled), passed by value as a
// __grid_constant__ kernel parameter.
struct __align__(64) TmaDesc {
  unsigned long long v[16];
};
// A shared-memory mbarrier expecting `count` arrivals per phase.
__device__ __forceinline__ void mbar_init(u64 *bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
// Makes initialised mbarriers visible to the async proxy (the bulk copies' complete_tx).
__device__ __forceinline__ void fence_mbar_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// One arrival that also expects `bytes` of bulk copies to complete on the barrier.
__device__ __forceinline__ void mbar_arrive_expect_tx(u64 *bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)),
               "r"(bytes)
               : "memory");
}
// One arrival.
__device__ __forceinline__ void mbar_arrive(u64 *bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
// MBAR_WATCHDOG=N (tuning): an mbarrier wait traps after 2^N failed tries, so that a
// kernel that would wait forever (a copy never issued) fails its launch instead of
// hanging the process. 0, the default: no count.
#ifndef MBAR_WATCHDOG
#define MBAR_WATCHDOG 0
#endif
// Waits until the barrier's phase of parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(u64 *bar, u32 parity) {
#if MBAR_WATCHDOG
  for (u32 tries = 0;; ++tries) {
    u32 done;
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
    if (done) return;
    if (tries >> MBAR_WATCHDOG) __trap();
  }
#else
  asm volatile(
      "{\n.reg .pred p;\nMBAR_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra MBAR_WAIT;\n}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
#endif
}
// The box of tensor map `map` at coordinates (c0, c1[, c2]) into shared memory at dst,
// completing its bytes on `bar`. Coordinates past the tensor read as zeros.
__device__ __forceinline__ void tma_load_2d(void *dst, const TmaDesc *map, u64 *bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          smem_u32(dst)),
      "l"((unsigned long long)map), "r"(c0), "r"(c1), "r"(smem_u32(bar))
      : "memory");
}
// tma_load_2d of a tile of `bytes` onto `bar` (its expected bytes first), issued where p
// holds, as predicated instructions.
__device__ __forceinline__ void tma_load_2d_expect_if(const bool p, void *dst, const TmaDesc *map,
                                                     u64 *bar, const u32 bytes, int c0, int c1) {
  asm volatile(
      "{\n.reg .pred q;\nsetp.ne.b32 q, %0, 0;\n"
      "@q mbarrier.arrive.expect_tx.shared::cta.b64 _, [%1], %2;\n"
      "@q cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%3], [%4, {%5, %6}], [%1];\n}\n" ::"r"(
          (u32)p),
      "r"(smem_u32(bar)), "r"(bytes), "r"(smem_u32(dst)), "l"((unsigned long long)map), "r"(c0),
      "r"(c1)
      : "memory");
}
// A global f32 store where p holds, as a predicated instruction.
__device__ __forceinline__ void st_global_f32_if(const bool p, float *addr, const float v) {
  asm volatile("{\n.reg .pred q;\nsetp.ne.b32 q, %0, 0;\n@q st.global.f32 [%1], %2;\n}\n" ::"r"(
                   (u32)p),
               "l"(addr), "f"(v)
               : "memory");
}
__device__ __forceinline__ void tma_load_3d(void *dst, const TmaDesc *map, u64 *bar, int c0, int c1,
                                            int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(
          smem_u32(dst)),
      "l"((unsigned long long)map), "r"(c0), "r"(c1), "r"(c2), "r"(smem_u32(bar))
      : "memory");
}
