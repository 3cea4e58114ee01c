// Error strings and the runtime version, for messages raised by the Python bindings.
#include <cuda_runtime.h>

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
