// Zig-zag context-parallel shard gather / scatter (see xorl_kernels.h and xorl_kernels/zigzag/reference.py).
#include "row_copy.cuh"
#include "xorl_kernels.h"

namespace xorl {
namespace {

struct ZigzagMap {
  const char* full_src;  // gather reads the full tensor ...
  char* full_dst;        // ... scatter writes it
  const char* local_src;
  char* local_dst;
  int64_t seq_len, local_len, local_rows, row_bytes;
  const int64_t* cu_seqlens;  // nullptr: one document of seq_len rows
  int64_t num_docs, rank_begin, world;

  // Global row (within the sequence) of local row t of rank q.
  __host__ __device__ int64_t global_row(int64_t q, int64_t t) const {
    int64_t start = 0, length = seq_len;
    if (cu_seqlens != nullptr) {
      // The document whose local part contains t: the last d with cu[d] / world <= t. Empty
      // documents share their start with the next one, and the last such d is the non-empty one.
      int64_t lo = 0, hi = num_docs - 1;
      while (lo < hi) {
        const int64_t mid = (lo + hi + 1) >> 1;
        if (cu_seqlens[mid] / world <= t) lo = mid; else hi = mid - 1;
      }
      start = cu_seqlens[lo];
      length = cu_seqlens[lo + 1] - start;
    }
    const int64_t chunk = length / (2 * world);
    const int64_t u = t - start / world;
    return start + (u < chunk ? q * chunk + u : (2 * world - 1 - q) * chunk + (u - chunk));
  }

  __host__ __device__ int64_t operator()(int64_t row, char*& dst, const char*& src) const {
    const int64_t o = row / local_rows;
    const int64_t j = row - o * local_rows;
    const int64_t q = rank_begin + j / local_len;
    const int64_t g = global_row(q, j % local_len);
    // cu_seqlens lives on the device and is validated there asynchronously (xorl_kernels/zigzag/reference.py);
    // a malformed one must still not make this kernel touch memory outside the tensors.
    const bool in_range = g >= 0 && g < seq_len;
    const int64_t full_off = (o * seq_len + g) * row_bytes;
    const int64_t local_off = (o * local_rows + j) * row_bytes;
    if (full_dst != nullptr) {
      dst = full_dst + full_off;
      src = local_src + local_off;
      return in_range ? row_bytes : 0;
    }
    dst = local_dst + local_off;
    src = in_range ? full_src + full_off : nullptr;  // nullptr: zero-fill
    return row_bytes;
  }
};

template <bool kHost>
int zigzag_copy(const void* full, void* local, int64_t outer, int64_t seq_len, int64_t row_bytes,
                const int64_t* cu_seqlens, int64_t num_docs, int64_t rank_begin, int64_t num_ranks, int64_t world,
                int scatter, cudaStream_t stream) {
  if (world < 1 || seq_len % (2 * world) != 0 || rank_begin < 0 || num_ranks < 0 ||
      rank_begin + num_ranks > world || outer < 0 || row_bytes < 0 || (cu_seqlens && num_docs < 1)) {
    return cudaErrorInvalidValue;
  }
  ZigzagMap map{};
  if (scatter) {
    map.full_dst = static_cast<char*>(const_cast<void*>(full));
    map.local_src = static_cast<const char*>(local);
  } else {
    map.full_src = static_cast<const char*>(full);
    map.local_dst = static_cast<char*>(local);
  }
  map.seq_len = seq_len;
  map.local_len = seq_len / world;
  map.local_rows = num_ranks * map.local_len;
  map.row_bytes = row_bytes;
  map.cu_seqlens = cu_seqlens;
  map.num_docs = num_docs;
  map.rank_begin = rank_begin;
  map.world = world;
  const int width = vector_width({addr(full), addr(local), uint64_t(row_bytes)});
  return run_row_copy<kHost>(map, outer * map.local_rows, row_bytes, width, stream);
}

}  // namespace
}  // namespace xorl

extern "C" int xorl_zigzag_copy(const void* full, void* local, int64_t outer, int64_t seq_len,
                                int64_t row_bytes, const int64_t* cu_seqlens, int64_t num_docs,
                                int64_t rank_begin, int64_t num_ranks, int64_t world, int scatter,
                                cudaStream_t stream) {
  return xorl::zigzag_copy<false>(full, local, outer, seq_len, row_bytes, cu_seqlens, num_docs, rank_begin,
                                  num_ranks, world, scatter, stream);
}

extern "C" int xorl_zigzag_copy_host(const void* full, void* local, int64_t outer, int64_t seq_len,
                                     int64_t row_bytes, const int64_t* cu_seqlens, int64_t num_docs,
                                     int64_t rank_begin, int64_t num_ranks, int64_t world, int scatter) {
  return xorl::zigzag_copy<true>(full, local, outer, seq_len, row_bytes, cu_seqlens, num_docs, rank_begin,
                                 num_ranks, world, scatter, nullptr);
}
