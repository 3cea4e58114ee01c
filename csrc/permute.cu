// MoE token permute (row gather) and unpermute (weighted combine of each token's K rows).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "row_copy.cuh"
#include "xorl_kernels.h"

namespace xorl {
namespace {

struct GatherRowsMap {
  const char* src;
  char* dst;
  const int64_t* index;
  int64_t num_src_rows, row_bytes;

  __host__ __device__ int64_t operator()(int64_t row, char*& d, const char*& s) const {
    const int64_t i = index[row];
    d = dst + row * row_bytes;
    s = (i >= 0 && i < num_src_rows) ? src + i * row_bytes : nullptr;
    return row_bytes;
  }
};

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

constexpr int kRowsInFlight = 4;

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// One group of 2^lanes_log2 lanes per token; each lane owns N consecutive features per step and
// sums the token's K rows into fp32 registers in k order, so the result does not depend on the
// launch shape (deterministic, no atomics).
template <typename T, int N>
__global__ void __launch_bounds__(kBlockThreads)
    unpermute_combine_kernel(const T* __restrict__ y, const int64_t* __restrict__ row_of_slot,
                             const float* __restrict__ weights, T* __restrict__ out, int64_t num_rows,
                             int64_t tokens, int64_t top_k, int64_t hidden, int lanes_log2) {
  const int lanes = 1 << lanes_log2;
  const int lane = threadIdx.x & (lanes - 1);
  const int64_t first = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> lanes_log2;
  const int64_t stride = (int64_t(gridDim.x) * blockDim.x) >> lanes_log2;
  const int64_t packs = hidden / N;
  for (int64_t t = first; t < tokens; t += stride) {
    const int64_t* rows = row_of_slot + t * top_k;
    const float* w = weights + t * top_k;
    for (int64_t p = lane; p < packs; p += lanes) {
      float acc[N];
#pragma unroll
      for (int e = 0; e < N; ++e) acc[e] = 0.f;
      // Up to kRowsInFlight rows are loaded before any is summed (memory-level parallelism);
      // the sum itself is still one fmaf per row in k order, so the result is the same.
      for (int64_t k0 = 0; k0 < top_k; k0 += kRowsInFlight) {
        Pack<T, N> v[kRowsInFlight];
        float wk[kRowsInFlight];
        bool valid[kRowsInFlight];
#pragma unroll
        for (int u = 0; u < kRowsInFlight; ++u) {
          const int64_t k = k0 + u;
          const int64_t r = k < top_k ? rows[k] : -1;
          valid[u] = r >= 0 && r < num_rows;  // past the end or a dropped slot: nothing to add
          if (valid[u]) {
            wk[u] = w[k];
            v[u] = reinterpret_cast<const Pack<T, N>*>(y + r * hidden)[p];
          }
        }
#pragma unroll
        for (int u = 0; u < kRowsInFlight; ++u) {
          if (!valid[u]) continue;
#pragma unroll
          for (int e = 0; e < N; ++e) acc[e] = fmaf(wk[u], to_float(v[u].v[e]), acc[e]);
        }
      }
      Pack<T, N> o;
#pragma unroll
      for (int e = 0; e < N; ++e) o.v[e] = from_float<T>(acc[e]);
      reinterpret_cast<Pack<T, N>*>(out + t * hidden)[p] = o;
    }
  }
}

template <typename T>
cudaError_t launch_combine(const void* y, const int64_t* row_of_slot, const float* weights, void* out,
                           int64_t num_rows, int64_t tokens, int64_t top_k, int64_t hidden,
                           cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vectorised = vector_width({addr(y), addr(out), uint64_t(hidden) * sizeof(T)}) == 16;
  const int64_t packs = vectorised ? hidden / kVec : hidden;
  const int lanes_log2 = lanes_log2_for(packs);
  const unsigned blocks = grid_blocks(tokens, kBlockThreads >> lanes_log2);
  const T* y_t = static_cast<const T*>(y);
  T* out_t = static_cast<T*>(out);
  if (vectorised) {
    unpermute_combine_kernel<T, kVec><<<blocks, kBlockThreads, 0, stream>>>(
        y_t, row_of_slot, weights, out_t, num_rows, tokens, top_k, hidden, lanes_log2);
  } else {
    unpermute_combine_kernel<T, 1><<<blocks, kBlockThreads, 0, stream>>>(
        y_t, row_of_slot, weights, out_t, num_rows, tokens, top_k, hidden, lanes_log2);
  }
  return cudaGetLastError();
}

}  // namespace
}  // namespace xorl

namespace xorl {
namespace {

template <bool kHost>
int permute_rows(const void* x, const int64_t* src_row, void* out, int64_t num_src_rows, int64_t num_out_rows,
                 int64_t row_bytes, cudaStream_t stream) {
  if (num_src_rows < 0 || num_out_rows < 0 || row_bytes < 0) return cudaErrorInvalidValue;
  const GatherRowsMap map{static_cast<const char*>(x), static_cast<char*>(out), src_row, num_src_rows, row_bytes};
  const int width = vector_width({addr(x), addr(out), uint64_t(row_bytes)});
  return run_row_copy<kHost>(map, num_out_rows, row_bytes, width, stream);
}

}  // namespace
}  // namespace xorl

extern "C" int xorl_permute_rows(const void* x, const int64_t* src_row, void* out, int64_t num_src_rows,
                                 int64_t num_out_rows, int64_t row_bytes, cudaStream_t stream) {
  return xorl::permute_rows<false>(x, src_row, out, num_src_rows, num_out_rows, row_bytes, stream);
}

extern "C" int xorl_permute_rows_host(const void* x, const int64_t* src_row, void* out, int64_t num_src_rows,
                                      int64_t num_out_rows, int64_t row_bytes) {
  return xorl::permute_rows<true>(x, src_row, out, num_src_rows, num_out_rows, row_bytes, nullptr);
}

extern "C" int xorl_unpermute_combine(const void* y, const int64_t* row_of_slot, const float* weights,
                                      void* out, int64_t num_rows, int64_t tokens, int64_t top_k,
                                      int64_t hidden, int dtype, cudaStream_t stream) {
  if (num_rows < 0 || tokens < 0 || top_k < 0 || hidden < 0) return cudaErrorInvalidValue;
  if (tokens == 0 || hidden == 0) return cudaSuccess;
  switch (dtype) {
    case 0:
      return xorl::launch_combine<float>(y, row_of_slot, weights, out, num_rows, tokens, top_k, hidden, stream);
    case 1:
      return xorl::launch_combine<__half>(y, row_of_slot, weights, out, num_rows, tokens, top_k, hidden, stream);
    case 2:
      return xorl::launch_combine<__nv_bfloat16>(y, row_of_slot, weights, out, num_rows, tokens, top_k, hidden,
                                                 stream);
    default:
      return cudaErrorInvalidValue;
  }
}
