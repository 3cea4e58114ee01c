// pybind11 bindings of the xorl CUDA kernels: integers in (device pointers as uintptr_t, the
// stream as the integer torch.cuda.current_stream().cuda_stream), a RuntimeError naming the
// kernel out when a launch fails. Shape, dtype and device checks live in xorl_kernels/cuda_ext.py
// and each op's csrc.py.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "xorl_kernels.h"

namespace py = pybind11;

namespace {

void check(int code, const char* kernel) {
  if (code != 0) {
    throw std::runtime_error(std::string("xorl_kernels._C.") + kernel + " failed: CUDA error " +
                             std::to_string(code) + " (" + xorl_cuda_error_string(code) + ")");
  }
}

template <typename T>
T* ptr(std::uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

cudaStream_t stream_of(std::uintptr_t handle) { return reinterpret_cast<cudaStream_t>(handle); }

using Segment = std::tuple<std::uintptr_t, std::uintptr_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                           int64_t>;

std::vector<xorl_block_copy_segment> to_segments(const std::vector<Segment>& segments, const char* kernel) {
  if (segments.size() > XORL_MAX_SEGMENTS) {
    throw std::invalid_argument(std::string("xorl_kernels._C.") + kernel + ": at most " +
                                std::to_string(XORL_MAX_SEGMENTS) + " segments per launch, got " +
                                std::to_string(segments.size()));
  }
  std::vector<xorl_block_copy_segment> raw(segments.size());
  for (size_t i = 0; i < segments.size(); ++i) {
    const Segment& s = segments[i];
    raw[i] = xorl_block_copy_segment{ptr<const void>(std::get<0>(s)), ptr<void>(std::get<1>(s)), std::get<2>(s),
                                     std::get<3>(s), std::get<4>(s), std::get<5>(s), std::get<6>(s), std::get<7>(s),
                                     std::get<8>(s)};
  }
  return raw;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "xorl CUDA kernels (raw pointers + a CUDA stream; see xorl_kernels/<op>/csrc.py for the checked wrappers)";

  m.def("cuda_runtime_version", &xorl_cuda_runtime_version,
        "CUDA runtime version the extension was built against (e.g. 13000).");
  m.def(
      "cuda_probe",
      []() {
        const int status = xorl_cuda_probe();
        return std::make_tuple(status, std::string(xorl_cuda_error_string(status)));
      },
      "(status, message) of cudaGetDeviceCount through the extension's own runtime (0 = usable).");
  m.def("routing_max_experts", &xorl_routing_max_experts);
  m.def("routing_workspace_elems", &xorl_routing_workspace_elems, py::arg("num_slots"), py::arg("num_experts"),
        "int64 elements of scratch the routing-metadata kernel needs.");

  m.def(
      "zigzag_copy",
      [](std::uintptr_t full, std::uintptr_t local, int64_t outer, int64_t seq_len, int64_t row_bytes,
         std::uintptr_t cu_seqlens, int64_t num_docs, int64_t rank_begin, int64_t num_ranks, int64_t world,
         bool scatter, std::uintptr_t stream) {
        check(xorl_zigzag_copy(ptr<const void>(full), ptr<void>(local), outer, seq_len, row_bytes,
                               ptr<const int64_t>(cu_seqlens), num_docs, rank_begin, num_ranks, world, scatter ? 1 : 0,
                               stream_of(stream)),
              "zigzag_copy");
      },
      py::arg("full"), py::arg("local"), py::arg("outer"), py::arg("seq_len"), py::arg("row_bytes"),
      py::arg("cu_seqlens"), py::arg("num_docs"), py::arg("rank_begin"), py::arg("num_ranks"), py::arg("world"),
      py::arg("scatter"), py::arg("stream"));

  m.def(
      "zigzag_copy_host",
      [](std::uintptr_t full, std::uintptr_t local, int64_t outer, int64_t seq_len, int64_t row_bytes,
         std::uintptr_t cu_seqlens, int64_t num_docs, int64_t rank_begin, int64_t num_ranks, int64_t world,
         bool scatter) {
        check(xorl_zigzag_copy_host(ptr<const void>(full), ptr<void>(local), outer, seq_len, row_bytes,
                                    ptr<const int64_t>(cu_seqlens), num_docs, rank_begin, num_ranks, world,
                                    scatter ? 1 : 0),
              "zigzag_copy_host");
      },
      "zigzag_copy on host memory (tests of the index map without a GPU).");

  m.def(
      "routing_metadata",
      [](std::uintptr_t expert_ids, bool ids_int64, int64_t num_slots, int64_t top_k, int64_t num_experts,
         std::uintptr_t workspace, std::uintptr_t tokens_per_expert, std::uintptr_t expert_offsets,
         std::uintptr_t row_map, std::uintptr_t sorted_slots, std::uintptr_t sorted_tokens, std::uintptr_t stream) {
        check(xorl_routing_metadata(ptr<const void>(expert_ids), ids_int64 ? 1 : 0, num_slots, top_k, num_experts,
                                    ptr<int64_t>(workspace), ptr<int64_t>(tokens_per_expert),
                                    ptr<int64_t>(expert_offsets), ptr<int64_t>(row_map), ptr<int64_t>(sorted_slots),
                                    ptr<int64_t>(sorted_tokens), stream_of(stream)),
              "routing_metadata");
      },
      py::arg("expert_ids"), py::arg("ids_int64"), py::arg("num_slots"), py::arg("top_k"), py::arg("num_experts"),
      py::arg("workspace"), py::arg("tokens_per_expert"), py::arg("expert_offsets"), py::arg("row_map"),
      py::arg("sorted_slots"), py::arg("sorted_tokens"), py::arg("stream"));

  m.def(
      "permute_rows",
      [](std::uintptr_t x, std::uintptr_t src_row, std::uintptr_t out, int64_t num_src_rows, int64_t num_out_rows,
         int64_t row_bytes, std::uintptr_t stream) {
        check(xorl_permute_rows(ptr<const void>(x), ptr<const int64_t>(src_row), ptr<void>(out), num_src_rows,
                                num_out_rows, row_bytes, stream_of(stream)),
              "permute_rows");
      },
      py::arg("x"), py::arg("src_row"), py::arg("out"), py::arg("num_src_rows"), py::arg("num_out_rows"),
      py::arg("row_bytes"), py::arg("stream"));

  m.def(
      "permute_rows_host",
      [](std::uintptr_t x, std::uintptr_t src_row, std::uintptr_t out, int64_t num_src_rows, int64_t num_out_rows,
         int64_t row_bytes) {
        check(xorl_permute_rows_host(ptr<const void>(x), ptr<const int64_t>(src_row), ptr<void>(out), num_src_rows,
                                     num_out_rows, row_bytes),
              "permute_rows_host");
      },
      "permute_rows on host memory (tests of the index map without a GPU).");

  m.def(
      "unpermute_combine",
      [](std::uintptr_t y, std::uintptr_t row_of_slot, std::uintptr_t weights, std::uintptr_t out, int64_t num_rows,
         int64_t tokens, int64_t top_k, int64_t hidden, int dtype, std::uintptr_t stream) {
        check(xorl_unpermute_combine(ptr<const void>(y), ptr<const int64_t>(row_of_slot), ptr<const float>(weights),
                                     ptr<void>(out), num_rows, tokens, top_k, hidden, dtype, stream_of(stream)),
              "unpermute_combine");
      },
      py::arg("y"), py::arg("row_of_slot"), py::arg("weights"), py::arg("out"), py::arg("num_rows"), py::arg("tokens"),
      py::arg("top_k"), py::arg("hidden"), py::arg("dtype"), py::arg("stream"));

  m.def(
      "unpermute_combine_host",
      [](std::uintptr_t y, std::uintptr_t row_of_slot, std::uintptr_t weights, std::uintptr_t out, int64_t num_rows,
         int64_t tokens, int64_t top_k, int64_t hidden, int dtype) {
        check(xorl_unpermute_combine_host(ptr<const void>(y), ptr<const int64_t>(row_of_slot),
                                          ptr<const float>(weights), ptr<void>(out), num_rows, tokens, top_k, hidden,
                                          dtype),
              "unpermute_combine_host");
      },
      "unpermute_combine on host memory (tests of the chunking and the fp32 sum without a GPU).");

  m.def(
      "row_copy_launch",
      [](int64_t rows, int64_t max_row_bytes, int width, int sms) {
        int64_t out[5] = {0, 0, 0, 0, 0};
        xorl_row_copy_launch(rows, max_row_bytes, width, sms, out);
        py::dict d;
        d["chunk_bytes"] = out[0];
        d["chunks_per_row"] = out[1];
        d["lanes"] = out[2];
        d["items"] = out[3];
        d["blocks"] = out[4];
        return d;
      },
      py::arg("rows"), py::arg("max_row_bytes"), py::arg("width"), py::arg("sms"),
      "The copy kernels' launch shape (chunk_bytes, chunks_per_row, lanes, items, blocks), computed on the host.");

  m.def(
      "block_transpose",
      [](const std::vector<Segment>& segments, std::uintptr_t stream) {
        const std::vector<xorl_block_copy_segment> raw = to_segments(segments, "block_transpose");
        check(xorl_block_transpose(raw.data(), static_cast<int>(raw.size()), stream_of(stream)), "block_transpose");
      },
      py::arg("segments"), py::arg("stream"),
      "segments: (src, dst, a_count, b_count, bytes, src_stride_a, src_stride_b, dst_stride_a, dst_stride_b)");
  m.def(
      "block_transpose_host",
      [](const std::vector<Segment>& segments) {
        const std::vector<xorl_block_copy_segment> raw = to_segments(segments, "block_transpose_host");
        check(xorl_block_transpose_host(raw.data(), static_cast<int>(raw.size())), "block_transpose_host");
      },
      py::arg("segments"), "block_transpose on host memory (tests of the index map without a GPU).");
  m.attr("max_segments") = XORL_MAX_SEGMENTS;
}
