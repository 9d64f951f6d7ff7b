// Checked cuDNN and cuBLASLt calls: a failure throws with the call, the library's explanation and the place.
#pragma once
#include <cublasLt.h>
#include <cudnn.h>

#include <stdexcept>
#include <string>

namespace rung {

[[noreturn]] inline void fail(const char* call, const std::string& status, const char* file, int line) {
  throw std::runtime_error(std::string(call) + ": " + status + " at " + file + ":" + std::to_string(line));
}

// The status name plus cuDNN's own explanation of the last failure (which names the offending attribute).
inline std::string cudnn_status(cudnnStatus_t s) {
  char detail[512] = {0};
  cudnnGetLastErrorString(detail, sizeof detail);
  return std::string(cudnnGetErrorString(s)) + (detail[0] ? std::string(" (") + detail + ")" : "");
}

#define CUDNN_CHECK(call)                                                                \
  do {                                                                                   \
    cudnnStatus_t s_ = (call);                                                           \
    if (s_ != CUDNN_STATUS_SUCCESS) rung::fail(#call, rung::cudnn_status(s_), __FILE__, __LINE__); \
  } while (0)

#define CUBLAS_CHECK(call)                                                                          \
  do {                                                                                              \
    cublasStatus_t s_ = (call);                                                                     \
    if (s_ != CUBLAS_STATUS_SUCCESS)                                                                \
      rung::fail(#call, std::string(cublasLtGetStatusName(s_)) + " " + cublasLtGetStatusString(s_), \
                 __FILE__, __LINE__);                                                               \
  } while (0)

}  // namespace rung
