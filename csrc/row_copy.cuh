// The shared engine of every data-movement kernel here: copy "rows" (contiguous byte runs) from
// wherever a mapping functor says to wherever it says.
//
// Why one engine: permute, zig-zag and Ulysses transposes are all "for each row r, copy n bytes
// from src(r) to dst(r)"; only the address arithmetic differs. The engine does the part that sets
// the bandwidth: 16-byte vector accesses when every address and size allows, rows cut into chunks
// of at most kChunkVectors vectors so a long row spreads over many lane groups (a Ulysses unpack
// moves a few rows of several MB each: one warp per row would leave the GPU idle), a group of
// 1..32 lanes per chunk (sized to the chunk so short rows do not idle a warp), several loads in
// flight per lane before the stores, a grid-stride loop over (row, chunk) items, and 64-bit
// indexing throughout.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <initializer_list>

namespace xorl {

constexpr int kBlockThreads = 256;
constexpr int kLoadsInFlight = 4;
// Vectors per chunk: 4 KiB at 16-byte access, 8 vectors per lane of a 32-lane group (two rounds
// of kLoadsInFlight). Small enough that a 1 MB row is 256 items, large enough that the per-item
// index arithmetic (a few divisions) is noise next to the copy.
constexpr int64_t kChunkVectors = 256;
// Blocks per SM the grid asks for at most (8 resident blocks of 256 threads fill an SM; twice
// that evens out the tail); the grid-stride loop takes the rest.
constexpr int64_t kBlocksPerSm = 16;

// Largest access width in {16, 8, 4, 2, 1} bytes that divides every value (addresses, sizes, strides).
inline int vector_width(std::initializer_list<uint64_t> values) {
  uint64_t width = 16;
  for (uint64_t v : values) {
    while (width > 1 && v % width != 0) width >>= 1;
  }
  return static_cast<int>(width);
}

// log2 of the lanes that share one item: the smallest power of two >= its vectors, at most 32.
inline int lanes_log2_for(int64_t vectors_per_item) {
  int log2 = 0;
  while (log2 < 5 && (int64_t(1) << log2) < vectors_per_item) ++log2;
  return log2;
}

// How one launch cuts its rows: item i is chunk (i % chunks_per_row) of row (i / chunks_per_row).
// Every row gets the longest row's chunk count; the trailing items of a shorter row are empty.
struct RowChunks {
  int64_t chunk_bytes = 0;     // a multiple of the access width
  int64_t chunks_per_row = 0;  // >= 1 when there is anything to copy
  int lanes_log2 = 0;          // lanes per item
};

inline RowChunks plan_row_chunks(int64_t max_row_bytes, int width) {
  RowChunks plan;
  const int64_t vectors = max_row_bytes / width;
  if (vectors <= 0) return plan;
  const int64_t chunk_vectors = vectors < kChunkVectors ? vectors : kChunkVectors;
  plan.chunk_bytes = chunk_vectors * width;
  plan.chunks_per_row = (vectors + chunk_vectors - 1) / chunk_vectors;
  plan.lanes_log2 = lanes_log2_for(chunk_vectors);
  return plan;
}

// Enough blocks for every item, at most kBlocksPerSm per SM; the kernels loop over the remainder.
inline int64_t grid_blocks_for(int64_t work_items, int64_t items_per_block, int sms) {
  int64_t want = (work_items + items_per_block - 1) / items_per_block;
  const int64_t cap = int64_t(sms) * kBlocksPerSm;
  if (want > cap) want = cap;
  return want < 1 ? 1 : want;
}

inline int device_sms() {
  int device = 0, sms = 132;
  if (cudaGetDevice(&device) == cudaSuccess) cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return sms;
}

inline unsigned grid_blocks(int64_t work_items, int64_t items_per_block) {
  return static_cast<unsigned>(grid_blocks_for(work_items, items_per_block, device_sms()));
}

// Item `item` of the plan: sets its addresses and returns its length in bytes (0: nothing to do).
// The one place the chunk arithmetic lives; the kernel and the host twin both call it.
template <typename Map>
__host__ __device__ __forceinline__ int64_t chunk_of(const Map& map, const RowChunks& plan, int64_t item,
                                                     char*& dst, const char*& src) {
  // Rows of one chunk (short rows: permute, Ulysses pack) skip the 64-bit division, which costs
  // as much as the map's own arithmetic when each item moves only a few hundred bytes.
  const int64_t row = plan.chunks_per_row == 1 ? item : item / plan.chunks_per_row;
  const int64_t begin = (item - row * plan.chunks_per_row) * plan.chunk_bytes;
  const int64_t bytes = map(row, dst, src);
  if (begin >= bytes) return 0;
  dst += begin;
  if (src != nullptr) src += begin;
  const int64_t left = bytes - begin;
  return left < plan.chunk_bytes ? left : plan.chunk_bytes;
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
__global__ void __launch_bounds__(kBlockThreads) row_copy_kernel(Map map, RowChunks plan, int64_t items) {
  const int lanes = 1 << plan.lanes_log2;
  const int lane = threadIdx.x & (lanes - 1);
  const int64_t first = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> plan.lanes_log2;
  const int64_t stride = (int64_t(gridDim.x) * blockDim.x) >> plan.lanes_log2;
  for (int64_t item = first; item < items; item += stride) {
    char* dst;
    const char* src;
    const int64_t bytes = chunk_of(map, plan, item, dst, src);
    copy_row<Vec>(dst, src, bytes / int64_t(sizeof(Vec)), lane, lanes);
  }
}

// The launch shape of one row copy, without launching: what the CPU tests check.
struct RowCopyLaunch {
  RowChunks plan;
  int64_t items = 0;
  int64_t blocks = 0;
};

inline RowCopyLaunch row_copy_launch(int64_t rows, int64_t max_row_bytes, int width, int sms) {
  RowCopyLaunch launch;
  launch.plan = plan_row_chunks(max_row_bytes, width);
  if (rows <= 0 || launch.plan.chunks_per_row == 0) return launch;
  launch.items = rows * launch.plan.chunks_per_row;
  launch.blocks = grid_blocks_for(launch.items, kBlockThreads >> launch.plan.lanes_log2, sms);
  return launch;
}

// Launch row_copy_kernel with the access width `width` (from vector_width over every address,
// row size and stride the map uses), rows cut into chunks and lanes sized to a chunk.
template <typename Map>
cudaError_t launch_row_copy(const Map& map, int64_t rows, int64_t max_row_bytes, int width,
                            cudaStream_t stream) {
  const RowCopyLaunch launch = row_copy_launch(rows, max_row_bytes, width, device_sms());
  if (launch.items == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>(launch.blocks);
  switch (width) {
    case 16:
      row_copy_kernel<uint4><<<blocks, kBlockThreads, 0, stream>>>(map, launch.plan, launch.items);
      break;
    case 8:
      row_copy_kernel<uint2><<<blocks, kBlockThreads, 0, stream>>>(map, launch.plan, launch.items);
      break;
    case 4:
      row_copy_kernel<uint32_t><<<blocks, kBlockThreads, 0, stream>>>(map, launch.plan, launch.items);
      break;
    case 2:
      row_copy_kernel<uint16_t><<<blocks, kBlockThreads, 0, stream>>>(map, launch.plan, launch.items);
      break;
    default:
      row_copy_kernel<uint8_t><<<blocks, kBlockThreads, 0, stream>>>(map, launch.plan, launch.items);
      break;
  }
  return cudaGetLastError();
}

// The same maps and the same chunk plan run on the CPU over host memory: how the index and chunk
// arithmetic is tested on machines without a GPU (the *_host entry points in xorl_kernels.h).
// Items run last to first: a chunk that overran the end of its row would then overwrite a row
// already written (rows are usually laid out in item order) and the test against the reference
// would see it, where in item order the next row's own copy would hide it.
template <typename Map>
void host_row_copy(const Map& map, int64_t rows, int64_t max_row_bytes, int width) {
  const RowCopyLaunch launch = row_copy_launch(rows, max_row_bytes, width, 1);
  for (int64_t item = launch.items - 1; item >= 0; --item) {
    char* dst;
    const char* src;
    const int64_t bytes = chunk_of(map, launch.plan, item, dst, src);
    if (bytes <= 0) continue;
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
    host_row_copy(map, rows, max_row_bytes, width);
    return cudaSuccess;
  } else {
    return launch_row_copy(map, rows, max_row_bytes, width, stream);
  }
}

inline uint64_t addr(const void* p) { return reinterpret_cast<uintptr_t>(p); }

}  // namespace xorl
