// Host-side queries for the Python bindings: error strings, the runtime version, the driver probe
// and the copy kernels' launch shape (which the CPU tests check).
#include <cuda_runtime.h>

#include "row_copy.cuh"
#include "xorl_kernels.h"

extern "C" const char* xorl_cuda_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

extern "C" int xorl_cuda_runtime_version(void) {
  int version = 0;
  cudaRuntimeGetVersion(&version);
  return version;
}

extern "C" int xorl_cuda_probe(void) {
  // Fails (e.g. cudaErrorInsufficientDriver) where the driver is older than the runtime linked in.
  int count = 0;
  return cudaGetDeviceCount(&count);
}

extern "C" void xorl_row_copy_launch(int64_t rows, int64_t max_row_bytes, int width, int sms, int64_t out[5]) {
  const xorl::RowCopyLaunch launch = xorl::row_copy_launch(rows, max_row_bytes, width, sms);
  out[0] = launch.plan.chunk_bytes;
  out[1] = launch.plan.chunks_per_row;
  out[2] = int64_t(1) << launch.plan.lanes_log2;
  out[3] = launch.items;
  out[4] = launch.blocks;
}
