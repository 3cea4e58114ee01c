// The shared engine of every data-movement kernel here: copy "rows" (contiguous byte runs) from
// wherever a mapping functor says to wherever it says.
//
// Why one engine: permute, zig-zag and Ulysses transposes are all "for each row r, copy n bytes
// from src(r) to dst(r)"; only the address arithmetic differs. The engine does the part that sets
// the bandwidth: 16-byte vector accesses when every address and size allows, a group of 1..32
// lanes per row (sized to the row so short rows do not idle a warp), several loads in flight per
// lane before the stores, a grid-stride loop over rows, and 64-bit indexing throughout.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <initializer_list>

namespace xorl {

constexpr int kBlockThreads = 256;
constexpr int kLoadsInFlight = 4;

// Largest access width in {16, 8, 4, 2, 1} bytes that divides every value (addresses, sizes, strides).
inline int vector_width(std::initializer_list<uint64_t> values) {
  uint64_t width = 16;
  for (uint64_t v : values) {
    while (width > 1 && v % width != 0) width >>= 1;
  }
  return static_cast<int>(width);
}

// log2 of the lanes that share one row: the smallest power of two >= vectors per row, at most 32.
inline int lanes_log2_for(int64_t vectors_per_row) {
  int log2 = 0;
  while (log2 < 5 && (int64_t(1) << log2) < vectors_per_row) ++log2;
  return log2;
}

// Enough blocks to fill the device several times over; the kernels loop over the remainder.
inline unsigned grid_blocks(int64_t work_items, int64_t items_per_block) {
  int device = 0, sms = 132;
  if (cudaGetDevice(&device) == cudaSuccess) cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  int64_t want = (work_items + items_per_block - 1) / items_per_block;
  int64_t cap = int64_t(sms) * 16;
  if (want > cap) want = cap;
  return static_cast<unsigned>(want < 1 ? 1 : want);
}

// Copy nvec vectors; lanes of one group take interleaved vectors so each access is coalesced.
// src == nullptr writes zeros.
template <typename Vec>
__device__ __forceinline__ void copy_row(char* dst_bytes, const char* src_bytes, int64_t nvec, int lane,
                                         int lanes) {
  Vec* dst = reinterpret_cast<Vec*>(dst_bytes);
  if (src_bytes == nullptr) {
    for (int64_t i = lane; i < nvec; i += lanes) dst[i] = Vec{};
    return;
  }
  const Vec* __restrict__ src = reinterpret_cast<const Vec*>(src_bytes);
  int64_t i = lane;
  for (; i + int64_t(kLoadsInFlight - 1) * lanes < nvec; i += int64_t(kLoadsInFlight) * lanes) {
    Vec v[kLoadsInFlight];
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) v[u] = src[i + int64_t(u) * lanes];
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) dst[i + int64_t(u) * lanes] = v[u];
  }
  for (; i < nvec; i += lanes) dst[i] = src[i];
}

// Map: `__host__ __device__ int64_t operator()(int64_t row, char*& dst, const char*& src) const` sets the
// row's addresses and returns its length in bytes (a multiple of sizeof(Vec)).
template <typename Vec, typename Map>
__global__ void __launch_bounds__(kBlockThreads) row_copy_kernel(Map map, int64_t rows, int lanes_log2) {
  const int lanes = 1 << lanes_log2;
  const int lane = threadIdx.x & (lanes - 1);
  const int64_t first = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> lanes_log2;
  const int64_t stride = (int64_t(gridDim.x) * blockDim.x) >> lanes_log2;
  for (int64_t row = first; row < rows; row += stride) {
    char* dst;
    const char* src;
    const int64_t bytes = map(row, dst, src);
    copy_row<Vec>(dst, src, bytes / int64_t(sizeof(Vec)), lane, lanes);
  }
}

// Launch row_copy_kernel with the access width `width` (from vector_width over every address,
// row size and stride the map uses) and lanes sized to the longest row.
template <typename Map>
cudaError_t launch_row_copy(const Map& map, int64_t rows, int64_t max_row_bytes, int width,
                            cudaStream_t stream) {
  if (rows <= 0 || max_row_bytes <= 0) return cudaSuccess;
  const int lanes_log2 = lanes_log2_for(max_row_bytes / width);
  const unsigned blocks = grid_blocks(rows, kBlockThreads >> lanes_log2);
  switch (width) {
    case 16:
      row_copy_kernel<uint4><<<blocks, kBlockThreads, 0, stream>>>(map, rows, lanes_log2);
      break;
    case 8:
      row_copy_kernel<uint2><<<blocks, kBlockThreads, 0, stream>>>(map, rows, lanes_log2);
      break;
    case 4:
      row_copy_kernel<uint32_t><<<blocks, kBlockThreads, 0, stream>>>(map, rows, lanes_log2);
      break;
    case 2:
      row_copy_kernel<uint16_t><<<blocks, kBlockThreads, 0, stream>>>(map, rows, lanes_log2);
      break;
    default:
      row_copy_kernel<uint8_t><<<blocks, kBlockThreads, 0, stream>>>(map, rows, lanes_log2);
      break;
  }
  return cudaGetLastError();
}

// The same maps run on the CPU over host memory: how the index arithmetic is tested on machines
// without a GPU (the *_host entry points in xorl_kernels.h).
template <typename Map>
void host_row_copy(const Map& map, int64_t rows) {
  for (int64_t row = 0; row < rows; ++row) {
    char* dst;
    const char* src;
    const int64_t bytes = map(row, dst, src);
    if (src != nullptr) {
      std::memcpy(dst, src, static_cast<size_t>(bytes));
    } else {
      std::memset(dst, 0, static_cast<size_t>(bytes));
    }
  }
}

template <bool kHost, typename Map>
cudaError_t run_row_copy(const Map& map, int64_t rows, int64_t max_row_bytes, int width, cudaStream_t stream) {
  if constexpr (kHost) {
    host_row_copy(map, rows);
    return cudaSuccess;
  } else {
    return launch_row_copy(map, rows, max_row_bytes, width, stream);
  }
}

inline uint64_t addr(const void* p) { return reinterpret_cast<uintptr_t>(p); }

}  // namespace xorl
