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
