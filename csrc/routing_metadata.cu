// MoE routing metadata: a stable counting sort of the (token, k) slots by expert, on the device,
// with no host synchronisation (see xorl_kernels/moe_permute/routing.py for the output definitions).
//
// Three launches over "tiles" of consecutive slots, one warp per tile:
//   1. tile_histogram: per-tile count of every bucket (E experts + 1 bucket for dropped ids);
//   2. tile_scan: per bucket, exclusive prefix of the tile counts over tiles (in place) + totals;
//   3. tile_place: every warp scans the totals into expert offsets, then walks its tile 32 slots
//      at a time; __match_any_sync finds the lanes with the same bucket, so a slot's row is
//      offset[bucket] + earlier tiles' count + earlier slots in this tile. Slot order is kept
//      (stable) and the result does not depend on scheduling (deterministic).
#include "row_copy.cuh"
#include "xorl_kernels.h"

namespace xorl {
namespace {

constexpr int kWarp = 32;
constexpr int64_t kMaxExperts = 4096;
constexpr int64_t kMinTile = 256;
constexpr int64_t kTargetTiles = 4096;
constexpr int kSharedBudget = 48 * 1024;

struct TilePlan {
  int64_t buckets, tile, num_tiles;
  int warps_per_block;
};

inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// Tiles hold at least as many slots as there are buckets, so the per-tile counts cost no more
// than the ids themselves, and are large enough that there are ~kTargetTiles of them at most.
inline TilePlan plan(int64_t num_slots, int64_t num_experts) {
  TilePlan p;
  p.buckets = num_experts + 1;
  p.tile = round_up(num_slots / kTargetTiles + 1, kWarp);
  if (p.tile < kMinTile) p.tile = kMinTile;
  if (p.tile < round_up(p.buckets, kWarp)) p.tile = round_up(p.buckets, kWarp);
  p.num_tiles = (num_slots + p.tile - 1) / p.tile;
  int64_t wpb = kSharedBudget / (p.buckets * int64_t(sizeof(int64_t)));
  p.warps_per_block = static_cast<int>(wpb < 1 ? 1 : (wpb > 4 ? 4 : wpb));
  return p;
}

template <typename Id>
__device__ __forceinline__ int bucket_of(Id id, int64_t num_experts) {
  return (id >= 0 && id < num_experts) ? static_cast<int>(id) : static_cast<int>(num_experts);
}

template <typename Id>
__global__ void tile_histogram_kernel(const Id* __restrict__ ids, int64_t num_slots, int64_t num_experts,
                                      int64_t tile, int64_t num_tiles, int64_t* __restrict__ counts) {
  extern __shared__ int32_t hist_smem[];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t buckets = num_experts + 1;
  const int64_t t = int64_t(blockIdx.x) * (blockDim.x / kWarp) + warp;
  if (t >= num_tiles) return;  // warps are independent: no block-wide barrier below
  int32_t* hist = hist_smem + warp * buckets;
  for (int64_t b = lane; b < buckets; b += kWarp) hist[b] = 0;
  __syncwarp();
  const int64_t begin = t * tile;
  const int64_t end = begin + tile < num_slots ? begin + tile : num_slots;
  for (int64_t s = begin + lane; s < end; s += kWarp) atomicAdd(&hist[bucket_of(ids[s], num_experts)], 1);
  __syncwarp();
  for (int64_t b = lane; b < buckets; b += kWarp) counts[t * buckets + b] = hist[b];
}

// Block (32 buckets) x (32 tile segments): each thread sums a run of tiles, one row of threads
// scans the 32 partial sums per bucket, then each thread rewrites its run as an exclusive prefix.
__global__ void tile_scan_kernel(int64_t* __restrict__ counts, int64_t num_tiles, int64_t buckets,
                                 int64_t* __restrict__ totals) {
  __shared__ int64_t part[kWarp][kWarp + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t b = int64_t(blockIdx.x) * kWarp + tx;
  const int64_t run = (num_tiles + kWarp - 1) / kWarp;
  const int64_t t0 = ty * run;
  const int64_t t1 = t0 + run < num_tiles ? t0 + run : num_tiles;
  int64_t sum = 0;
  if (b < buckets) {
#pragma unroll 8
    for (int64_t t = t0; t < t1; ++t) sum += counts[t * buckets + b];
  }
  part[ty][tx] = sum;
  __syncthreads();
  if (ty == 0) {
    int64_t running = 0;
    for (int i = 0; i < kWarp; ++i) {
      const int64_t v = part[i][tx];
      part[i][tx] = running;
      running += v;
    }
    if (b < buckets) totals[b] = running;
  }
  __syncthreads();
  if (b < buckets) {
    int64_t prefix = part[ty][tx];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t c = counts[t * buckets + b];
      counts[t * buckets + b] = prefix;
      prefix += c;
    }
  }
}

template <typename Id>
__global__ void tile_place_kernel(const Id* __restrict__ ids, int64_t num_slots, int64_t top_k,
                                  int64_t num_experts, int64_t tile, int64_t num_tiles,
                                  const int64_t* __restrict__ counts, const int64_t* __restrict__ totals,
                                  int64_t* __restrict__ tokens_per_expert, int64_t* __restrict__ expert_offsets,
                                  int64_t* __restrict__ row_map, int64_t* __restrict__ sorted_slots,
                                  int64_t* __restrict__ sorted_tokens) {
  extern __shared__ int64_t cursor_smem[];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t buckets = num_experts + 1;
  const int64_t t = int64_t(blockIdx.x) * (blockDim.x / kWarp) + warp;
  if (t >= num_tiles) return;
  int64_t* cursor = cursor_smem + warp * buckets;

  // cursor[b] = first row of bucket b (exclusive scan of totals) + rows taken by earlier tiles.
  int64_t carry = 0;
  for (int64_t base = 0; base < buckets; base += kWarp) {
    const int64_t b = base + lane;
    const int64_t v = b < buckets ? totals[b] : 0;
    int64_t incl = v;
#pragma unroll
    for (int d = 1; d < kWarp; d <<= 1) {
      const int64_t up = __shfl_up_sync(0xffffffffu, incl, d);
      if (lane >= d) incl += up;
    }
    const int64_t excl = carry + incl - v;
    if (b < buckets) {
      cursor[b] = excl + counts[t * buckets + b];
      if (t == 0) {
        if (b < num_experts) tokens_per_expert[b] = v;
        expert_offsets[b] = excl;  // b == num_experts: the number of kept (non-dropped) slots
      }
    }
    carry += __shfl_sync(0xffffffffu, incl, kWarp - 1);
  }
  __syncwarp();

  const int64_t begin = t * tile;
  const int64_t end = begin + tile < num_slots ? begin + tile : num_slots;
  const unsigned lanes_below = (1u << lane) - 1u;
  for (int64_t s0 = begin; s0 < end; s0 += kWarp) {
    const int64_t s = s0 + lane;
    const bool active = s < end;
    const int key = active ? bucket_of(ids[s], num_experts) : -1;
    const unsigned peers = __match_any_sync(0xffffffffu, key);
    const int rank = __popc(peers & lanes_below);
    const int64_t row = active ? cursor[key] + rank : 0;
    __syncwarp();
    if (active && rank == __popc(peers) - 1) cursor[key] += __popc(peers);  // last peer advances
    __syncwarp();
    if (active) {
      row_map[s] = row;
      sorted_slots[row] = s;
      sorted_tokens[row] = s / top_k;
    }
  }
}

template <typename Id>
cudaError_t launch_routing(const Id* ids, int64_t num_slots, int64_t top_k, int64_t num_experts,
                           int64_t* workspace, int64_t* tokens_per_expert, int64_t* expert_offsets,
                           int64_t* row_map, int64_t* sorted_slots, int64_t* sorted_tokens, cudaStream_t stream) {
  const TilePlan p = plan(num_slots, num_experts);
  int64_t* counts = workspace;
  int64_t* totals = workspace + p.num_tiles * p.buckets;
  if (p.num_tiles == 0) {
    // No slots: every count and offset is zero.
    cudaError_t err = cudaMemsetAsync(tokens_per_expert, 0, sizeof(int64_t) * num_experts, stream);
    if (err == cudaSuccess) err = cudaMemsetAsync(expert_offsets, 0, sizeof(int64_t) * (num_experts + 1), stream);
    return err;
  }
  const unsigned blocks = static_cast<unsigned>((p.num_tiles + p.warps_per_block - 1) / p.warps_per_block);
  const int threads = p.warps_per_block * kWarp;
  tile_histogram_kernel<Id><<<blocks, threads, p.warps_per_block * p.buckets * sizeof(int32_t), stream>>>(
      ids, num_slots, num_experts, p.tile, p.num_tiles, counts);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const unsigned scan_blocks = static_cast<unsigned>((p.buckets + kWarp - 1) / kWarp);
  tile_scan_kernel<<<scan_blocks, dim3(kWarp, kWarp), 0, stream>>>(counts, p.num_tiles, p.buckets, totals);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  tile_place_kernel<Id><<<blocks, threads, p.warps_per_block * p.buckets * sizeof(int64_t), stream>>>(
      ids, num_slots, top_k, num_experts, p.tile, p.num_tiles, counts, totals, tokens_per_expert, expert_offsets,
      row_map, sorted_slots, sorted_tokens);
  return cudaGetLastError();
}

}  // namespace
}  // namespace xorl

extern "C" int64_t xorl_routing_max_experts(void) { return xorl::kMaxExperts; }

extern "C" int64_t xorl_routing_workspace_elems(int64_t num_slots, int64_t num_experts) {
  const xorl::TilePlan p = xorl::plan(num_slots, num_experts);
  return p.num_tiles * p.buckets + p.buckets;
}

extern "C" int xorl_routing_metadata(const void* expert_ids, int ids_int64, int64_t num_slots, int64_t top_k,
                                     int64_t num_experts, int64_t* workspace, int64_t* tokens_per_expert,
                                     int64_t* expert_offsets, int64_t* row_map, int64_t* sorted_slots,
                                     int64_t* sorted_tokens, cudaStream_t stream) {
  if (num_slots < 0 || top_k < 1 || num_experts < 1 || num_experts > xorl::kMaxExperts ||
      num_slots % top_k != 0) {
    return cudaErrorInvalidValue;
  }
  if (ids_int64) {
    return xorl::launch_routing(static_cast<const int64_t*>(expert_ids), num_slots, top_k, num_experts, workspace,
                                tokens_per_expert, expert_offsets, row_map, sorted_slots, sorted_tokens, stream);
  }
  return xorl::launch_routing(static_cast<const int32_t*>(expert_ids), num_slots, top_k, num_experts, workspace,
                              tokens_per_expert, expert_offsets, row_map, sorted_slots, sorted_tokens, stream);
}
