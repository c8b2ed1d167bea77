// A C ABI over FlashInfer's top-k page-table transform, for benches/peers.py (ctypes).
//
// Built by build.sh against the headers of a flashinfer-python wheel; no FlashInfer code is
// kept in this repository. The entry point makes the same call that FlashInfer's own launcher
// `radix_topk_page_table_transform` (csrc/topk.cu) makes for f32 rows, page size 1, no raw
// index output and no tie-break: `sampling::TopKPageTableTransformDispatch`, which picks
// FilteredTopK or the multi-CTA RadixTopK by FlashInfer's heuristic, with the page-table
// policy that launcher picks (the configurable one when the row stride differs from the row
// length or the rows are not 16-byte aligned).
//
// Every pointer is a device pointer on the current device; `stream` is a cudaStream_t.
// Returns a cudaError_t value (0 on success).

#include <cstdint>
// topk.cuh uses math.cuh without including it (FlashInfer includes it through sampling.cuh).
#include <flashinfer/math.cuh>
#include <flashinfer/topk.cuh>

using flashinfer::sampling::ConfigurablePageTableKernelPolicy;
using flashinfer::sampling::DirectPageTableKernelPolicy;
using flashinfer::sampling::RadixRowState;
using flashinfer::sampling::ShouldUseFilteredTopK;
using flashinfer::sampling::TopKPageTableTransformDispatch;
using flashinfer::sampling::TopKTieBreak;
using flashinfer::sampling::TOPK_MAX_VECTOR_BYTES;

extern "C" {

// ABI version of this file, so the loader can refuse a stale build.
int dsa_fi_abi_version() { return 1; }

// Bytes of the zero-initialised row-state buffer the multi-CTA path needs (FlashInfer's
// Python side allocates 1 MiB and keeps it between calls).
int64_t dsa_fi_row_state_bytes() { return int64_t(1) << 20; }

int64_t dsa_fi_row_state_size() { return int64_t(sizeof(RadixRowState)); }

// 1 when FlashInfer's heuristic takes FilteredTopK for f32 rows of this shape, 0 when it takes
// the multi-CTA RadixTopK.
int dsa_fi_uses_filtered(uint32_t num_rows, uint32_t top_k, uint32_t max_len, int deterministic) {
  return ShouldUseFilteredTopK<float>(num_rows, top_k, max_len, deterministic != 0,
                                      TopKTieBreak::None, false)
             ? 1
             : 0;
}

// Top-k of f32 rows through a page table, as `flashinfer.top_k_page_table_transform(input,
// src_page_table, lengths, k, row_to_batch, deterministic, row_starts=row_starts)` with page
// size 1: row i selects the top `top_k` of input[i, row_starts[i] .. row_starts[i] +
// lengths[i]) and writes src_page_table[b, row_starts[i] + idx] (b = row_to_batch[i], or i),
// -1 past the row's length. `input` has `num_rows` rows of `max_len` values, `input_stride`
// values apart; `row_starts` and `row_to_batch` may be null.
int dsa_fi_top_k_page_table_transform(const float* input, int64_t input_stride, int32_t* out,
                                      const int32_t* src_page_table, int64_t src_stride,
                                      int32_t* lengths, const int32_t* row_starts,
                                      const int32_t* row_to_batch, uint32_t num_rows,
                                      uint32_t top_k, uint32_t max_len, void* row_states,
                                      int deterministic, void* stream) {
  if (input == nullptr || out == nullptr || src_page_table == nullptr || lengths == nullptr ||
      row_states == nullptr || top_k == 0 || input_stride < int64_t(max_len)) {
    return int(cudaErrorInvalidValue);
  }
  float* in = const_cast<float*>(input);
  auto* rs = static_cast<RadixRowState*>(row_states);
  auto st = static_cast<cudaStream_t>(stream);
  const bool configurable =
      input_stride != int64_t(max_len) ||
      (row_starts == nullptr &&
       reinterpret_cast<std::uintptr_t>(input) % TOPK_MAX_VECTOR_BYTES != 0);
  cudaError_t e;
  if (configurable) {
    e = TopKPageTableTransformDispatch<float, int32_t, ConfigurablePageTableKernelPolicy<int32_t>>(
        in, out, src_page_table, src_stride, lengths, row_starts, row_to_batch, num_rows, top_k,
        max_len, rs, deterministic != 0, TopKTieBreak::None, st, false, nullptr,
        ConfigurablePageTableKernelPolicy<int32_t>{nullptr, input_stride, 0});
  } else {
    e = TopKPageTableTransformDispatch<float, int32_t, DirectPageTableKernelPolicy<int32_t>>(
        in, out, src_page_table, src_stride, lengths, row_starts, row_to_batch, num_rows, top_k,
        max_len, rs, deterministic != 0, TopKTieBreak::None, st, false, nullptr,
        DirectPageTableKernelPolicy<int32_t>{});
  }
  if (e == cudaSuccess) {
    e = cudaGetLastError();
  }
  return int(e);
}

const char* dsa_fi_error_string(int e) { return cudaGetErrorString(static_cast<cudaError_t>(e)); }

}  // extern "C"
