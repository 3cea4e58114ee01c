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

__host__ __device__ __forceinline__ float to_float(float v) { return v; }
__host__ __device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__host__ __device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __host__ __device__ __forceinline__ T from_float(float v);
template <> __host__ __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __host__ __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __host__ __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

constexpr int kRowsInFlight = 4;

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <typename T>
struct CombineArgs {
  const T* y;
  const int64_t* row_of_slot;  // [tokens, top_k]
  const float* weights;        // [tokens, top_k]
  T* out;
  int64_t num_rows, tokens, top_k, hidden;
};

// out[t] packs p (N consecutive features): the token's K rows summed into fp32 in k order, so the
// result does not depend on the launch shape (deterministic, no atomics). Host and device share it.
template <typename T, int N>
__host__ __device__ __forceinline__ void combine_pack(const CombineArgs<T>& a, int64_t t, int64_t p) {
  const int64_t* rows = a.row_of_slot + t * a.top_k;
  const float* w = a.weights + t * a.top_k;
  float acc[N];
#pragma unroll
  for (int e = 0; e < N; ++e) acc[e] = 0.f;
  // Up to kRowsInFlight rows are loaded before any is summed (memory-level parallelism); the sum
  // itself is still one fmaf per row in k order, so the result is the same.
  for (int64_t k0 = 0; k0 < a.top_k; k0 += kRowsInFlight) {
    Pack<T, N> v[kRowsInFlight];
    float wk[kRowsInFlight];
    bool valid[kRowsInFlight];
#pragma unroll
    for (int u = 0; u < kRowsInFlight; ++u) {
      const int64_t k = k0 + u;
      const int64_t r = k < a.top_k ? rows[k] : -1;
      valid[u] = r >= 0 && r < a.num_rows;  // past the end or a dropped slot: nothing to add
      if (valid[u]) {
        wk[u] = w[k];
        v[u] = reinterpret_cast<const Pack<T, N>*>(a.y + r * a.hidden)[p];
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
  reinterpret_cast<Pack<T, N>*>(a.out + t * a.hidden)[p] = o;
}

// Item `item` of the plan (the row-copy chunk plan, counted in packs instead of bytes): its token
// and its packs [begin, end).
__host__ __device__ __forceinline__ int64_t combine_item(const RowChunks& plan, int64_t packs, int64_t item,
                                                         int64_t& begin, int64_t& end) {
  const int64_t t = plan.chunks_per_row == 1 ? item : item / plan.chunks_per_row;  // as in chunk_of
  begin = (item - t * plan.chunks_per_row) * plan.chunk_bytes;
  end = begin + plan.chunk_bytes < packs ? begin + plan.chunk_bytes : packs;
  return t;
}

// One group of 2^lanes_log2 lanes per (token, chunk of packs) item: a few tokens with a wide
// hidden size still spread over the whole GPU.
template <typename T, int N>
__global__ void __launch_bounds__(kBlockThreads)
    unpermute_combine_kernel(CombineArgs<T> a, RowChunks plan, int64_t items) {
  const int lanes = 1 << plan.lanes_log2;
  const int lane = threadIdx.x & (lanes - 1);
  const int64_t first = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> plan.lanes_log2;
  const int64_t stride = (int64_t(gridDim.x) * blockDim.x) >> plan.lanes_log2;
  const int64_t packs = a.hidden / N;
  for (int64_t item = first; item < items; item += stride) {
    int64_t begin, end;
    const int64_t t = combine_item(plan, packs, item, begin, end);
    for (int64_t p = begin + lane; p < end; p += lanes) combine_pack<T, N>(a, t, p);
  }
}

template <typename T, int N>
void host_combine(const CombineArgs<T>& a, const RowChunks& plan, int64_t items) {
  const int64_t packs = a.hidden / N;
  for (int64_t item = items - 1; item >= 0; --item) {  // last to first, as host_row_copy
    int64_t begin, end;
    const int64_t t = combine_item(plan, packs, item, begin, end);
    for (int64_t p = begin; p < end; ++p) combine_pack<T, N>(a, t, p);
  }
}

template <bool kHost, typename T, int N>
cudaError_t run_combine_packed(const CombineArgs<T>& a, cudaStream_t stream) {
  const RowCopyLaunch launch = row_copy_launch(a.tokens, a.hidden / N, 1, kHost ? 1 : device_sms());
  if (launch.items == 0) return cudaSuccess;
  if constexpr (kHost) {
    host_combine<T, N>(a, launch.plan, launch.items);
    return cudaSuccess;
  } else {
    unpermute_combine_kernel<T, N>
        <<<static_cast<unsigned>(launch.blocks), kBlockThreads, 0, stream>>>(a, launch.plan, launch.items);
    return cudaGetLastError();
  }
}

template <bool kHost, typename T>
cudaError_t run_combine(const void* y, const int64_t* row_of_slot, const float* weights, void* out,
                        int64_t num_rows, int64_t tokens, int64_t top_k, int64_t hidden, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const CombineArgs<T> a{static_cast<const T*>(y), row_of_slot, weights, static_cast<T*>(out),
                         num_rows, tokens, top_k, hidden};
  if (vector_width({addr(y), addr(out), uint64_t(hidden) * sizeof(T)}) == 16) {
    return run_combine_packed<kHost, T, kVec>(a, stream);
  }
  return run_combine_packed<kHost, T, 1>(a, stream);
}

template <bool kHost>
int unpermute_combine(const void* y, const int64_t* row_of_slot, const float* weights, void* out, int64_t num_rows,
                      int64_t tokens, int64_t top_k, int64_t hidden, int dtype, cudaStream_t stream) {
  if (num_rows < 0 || tokens < 0 || top_k < 0 || hidden < 0) return cudaErrorInvalidValue;
  if (tokens == 0 || hidden == 0) return cudaSuccess;
  switch (dtype) {
    case 0:
      return run_combine<kHost, float>(y, row_of_slot, weights, out, num_rows, tokens, top_k, hidden, stream);
    case 1:
      return run_combine<kHost, __half>(y, row_of_slot, weights, out, num_rows, tokens, top_k, hidden, stream);
    case 2:
      return run_combine<kHost, __nv_bfloat16>(y, row_of_slot, weights, out, num_rows, tokens, top_k, hidden,
                                               stream);
    default:
      return cudaErrorInvalidValue;
  }
}

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
  return xorl::unpermute_combine<false>(y, row_of_slot, weights, out, num_rows, tokens, top_k, hidden, dtype,
                                        stream);
}

extern "C" int xorl_unpermute_combine_host(const void* y, const int64_t* row_of_slot, const float* weights,
                                           void* out, int64_t num_rows, int64_t tokens, int64_t top_k,
                                           int64_t hidden, int dtype) {
  return xorl::unpermute_combine<true>(y, row_of_slot, weights, out, num_rows, tokens, top_k, hidden, dtype,
                                       nullptr);
}
