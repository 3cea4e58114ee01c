// C interface of the xorl CUDA kernels: raw device pointers, sizes and a CUDA stream.
//
// Why no torch types: the extension then does not depend on the torch C++ ABI, so one build serves
// every torch version and it compiles and links with nvcc (cudart only) on a machine with no GPU.
// Every launcher returns a cudaError_t value (0 = success): the launch status
// (cudaGetLastError) or cudaErrorInvalidValue (1) for arguments it cannot honour. Launches are
// asynchronous on `stream`; nothing here synchronises with the host.
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// The runtime's own definition (driver_types.h), repeated so bindings.cpp needs no CUDA headers.
typedef struct CUstream_st* cudaStream_t;

const char* xorl_cuda_error_string(int code);
int xorl_cuda_runtime_version(void);
int xorl_cuda_probe(void);  // cudaGetDeviceCount's status: can this runtime talk to the driver?

// Zig-zag context-parallel shard copy, byte-wise (dtype-agnostic).
// The full tensor is viewed as [outer, seq_len, row_bytes]; a rank's shard as
// [outer, seq_len / world, row_bytes]. A document of length L (L % (2*world) == 0) is cut into
// 2*world chunks of c = L / (2*world) rows and rank q holds chunks q and 2*world-1-q, in that order;
// the shard concatenates its part of every document. cu_seqlens (int64, num_docs + 1 entries,
// 0 .. seq_len) may be NULL: one document of seq_len rows. The local side holds the shards of
// ranks rank_begin .. rank_begin+num_ranks-1 one after another: [outer, num_ranks * seq_len/world].
// scatter == 0: local <- full (gather); scatter != 0: full <- local (the inverse).
int xorl_zigzag_copy(const void* full, void* local, int64_t outer, int64_t seq_len, int64_t row_bytes,
                     const int64_t* cu_seqlens, int64_t num_docs, int64_t rank_begin, int64_t num_ranks,
                     int64_t world, int scatter, cudaStream_t stream);

// MoE routing metadata. expert_ids: num_slots = tokens * top_k ids (int32, or int64 if ids_int64).
// workspace: xorl_routing_workspace_elems(num_slots, num_experts) int64 values (contents ignored).
// Outputs (int64): tokens_per_expert [E], expert_offsets [E + 1], row_map [num_slots],
// sorted_slots [num_slots], sorted_tokens [num_slots]. Ids outside [0, E) are treated as dropped:
// they sort after every expert and are not counted. Definitions are in xorl_kernels/moe_permute/routing.py.
int64_t xorl_routing_workspace_elems(int64_t num_slots, int64_t num_experts);
int64_t xorl_routing_max_experts(void);
int xorl_routing_metadata(const void* expert_ids, int ids_int64, int64_t num_slots, int64_t top_k,
                          int64_t num_experts, int64_t* workspace, int64_t* tokens_per_expert,
                          int64_t* expert_offsets, int64_t* row_map, int64_t* sorted_slots,
                          int64_t* sorted_tokens, cudaStream_t stream);

// out[r] = x[src_row[r]] for rows of row_bytes bytes; an index outside [0, num_src_rows) gives a
// zero row.
int xorl_permute_rows(const void* x, const int64_t* src_row, void* out, int64_t num_src_rows,
                      int64_t num_out_rows, int64_t row_bytes, cudaStream_t stream);

// out[t] = sum_k weights[t, k] * y[row_of_slot[t, k]] accumulated in fp32 in k order (no atomics),
// stored in y's dtype (0 = fp32, 1 = fp16, 2 = bf16). A row index outside [0, num_rows) adds nothing.
int xorl_unpermute_combine(const void* y, const int64_t* row_of_slot, const float* weights, void* out,
                           int64_t num_rows, int64_t tokens, int64_t top_k, int64_t hidden, int dtype,
                           cudaStream_t stream);

// Block transpose, the data movement of Ulysses pack/unpack: for every segment, for a in [0,
// a_count) and b in [0, b_count), copy `bytes` bytes from src + a*src_stride_a + b*src_stride_b to
// dst + a*dst_stride_a + b*dst_stride_b (strides in bytes). Up to XORL_MAX_SEGMENTS segments per
// launch, so Q, K and V move in one kernel.
#define XORL_MAX_SEGMENTS 4
typedef struct {
  const void* src;
  void* dst;
  int64_t a_count, b_count, bytes;
  int64_t src_stride_a, src_stride_b, dst_stride_a, dst_stride_b;
} xorl_block_copy_segment;

int xorl_block_transpose(const xorl_block_copy_segment* segments, int num_segments, cudaStream_t stream);

// Host emulation, for tests on machines without a GPU: the same index maps, run on the CPU over
// host pointers (one memcpy per (row, chunk) item of the same launch plan). Same arguments as the
// device launchers, minus the stream.
int xorl_zigzag_copy_host(const void* full, void* local, int64_t outer, int64_t seq_len, int64_t row_bytes,
                          const int64_t* cu_seqlens, int64_t num_docs, int64_t rank_begin, int64_t num_ranks,
                          int64_t world, int scatter);
int xorl_permute_rows_host(const void* x, const int64_t* src_row, void* out, int64_t num_src_rows,
                           int64_t num_out_rows, int64_t row_bytes);
int xorl_block_transpose_host(const xorl_block_copy_segment* segments, int num_segments);
// Same arguments as xorl_unpermute_combine, minus the stream; the same fp32 k-order sum per pack.
int xorl_unpermute_combine_host(const void* y, const int64_t* row_of_slot, const float* weights, void* out,
                                int64_t num_rows, int64_t tokens, int64_t top_k, int64_t hidden, int dtype);

// The launch shape the copy kernels above use for `rows` rows of at most max_row_bytes bytes with
// `width`-byte accesses on a GPU with `sms` SMs (the combine: rows = tokens, max_row_bytes =
// hidden / pack size, width = 1). Writes, in order: chunk_bytes, chunks_per_row, lanes per item,
// items (rows * chunks_per_row), blocks of 256 threads. Pure host arithmetic (no GPU needed).
void xorl_row_copy_launch(int64_t rows, int64_t max_row_bytes, int width, int sms, int64_t out[5]);

#ifdef __cplusplus
}
#endif
