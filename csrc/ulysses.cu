// Block transpose: the data movement of Ulysses pack / unpack (see xorl_kernels/ulysses/reference.py for the
// layouts). Several segments (Q, K, V) in one launch so the three move in one kernel.
#include "row_copy.cuh"
#include "xorl_kernels.h"

namespace xorl {
namespace {

struct BlockTransposeMap {
  xorl_block_copy_segment seg[XORL_MAX_SEGMENTS];
  int64_t first_row[XORL_MAX_SEGMENTS + 1];  // rows of segment s: [first_row[s], first_row[s+1])
  int num_segments;

  __host__ __device__ int64_t operator()(int64_t row, char*& dst, const char*& src) const {
    int s = 0;
    while (s + 1 < num_segments && row >= first_row[s + 1]) ++s;
    const xorl_block_copy_segment& g = seg[s];
    const int64_t r = row - first_row[s];
    const int64_t a = r / g.b_count;
    const int64_t b = r - a * g.b_count;
    src = static_cast<const char*>(g.src) + a * g.src_stride_a + b * g.src_stride_b;
    dst = static_cast<char*>(g.dst) + a * g.dst_stride_a + b * g.dst_stride_b;
    return g.bytes;
  }
};

template <bool kHost>
int block_transpose(const xorl_block_copy_segment* segments, int num_segments, cudaStream_t stream) {
  if (num_segments < 0 || num_segments > XORL_MAX_SEGMENTS) return cudaErrorInvalidValue;
  BlockTransposeMap map{};
  map.num_segments = num_segments;
  int64_t rows = 0, max_bytes = 0;
  uint64_t width = 16;
  for (int s = 0; s < num_segments; ++s) {
    const xorl_block_copy_segment& g = segments[s];
    if (g.a_count < 0 || g.b_count < 0 || g.bytes < 0) return cudaErrorInvalidValue;
    map.seg[s] = g;
    map.first_row[s] = rows;
    rows += g.a_count * g.b_count;
    if (g.bytes > max_bytes) max_bytes = g.bytes;
    width = vector_width({width, addr(g.src), addr(g.dst), uint64_t(g.bytes),
                                uint64_t(g.src_stride_a), uint64_t(g.src_stride_b), uint64_t(g.dst_stride_a),
                                uint64_t(g.dst_stride_b)});
  }
  map.first_row[num_segments] = rows;
  return run_row_copy<kHost>(map, rows, max_bytes, static_cast<int>(width), stream);
}

}  // namespace
}  // namespace xorl

extern "C" int xorl_block_transpose(const xorl_block_copy_segment* segments, int num_segments,
                                    cudaStream_t stream) {
  return xorl::block_transpose<false>(segments, num_segments, stream);
}

extern "C" int xorl_block_transpose_host(const xorl_block_copy_segment* segments, int num_segments) {
  return xorl::block_transpose<true>(segments, num_segments, nullptr);
}
