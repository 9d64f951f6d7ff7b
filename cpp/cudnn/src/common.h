// What every file of the cuDNN rung shares: checked calls, the precision of a run, device memory accounting and
// event timing.
#pragma once
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "ladder/protocol.h"  // LADDER_CUDA

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

// How weights and activations are stored; accumulation is fp32 in every case.
enum class Storage { F32, F16, BF16 };

struct Precision {
  std::string name;       // the contract's --dtype: fp32 | tf32 | fp16 | bf16
  Storage storage;
  cudnnDataType_t cudnn;  // storage type for cuDNN
  cudaDataType_t cuda;    // the same for cuBLASLt
  size_t bytes;           // per element
  bool tf32;              // fp32 data, TF32 tensor-core math allowed

  static Precision parse(const std::string& dtype) {
    if (dtype == "fp32") return {dtype, Storage::F32, CUDNN_DATA_FLOAT, CUDA_R_32F, 4, false};
    if (dtype == "tf32") return {dtype, Storage::F32, CUDNN_DATA_FLOAT, CUDA_R_32F, 4, true};
    if (dtype == "fp16") return {dtype, Storage::F16, CUDNN_DATA_HALF, CUDA_R_16F, 2, false};
    if (dtype == "bf16") return {dtype, Storage::BF16, CUDNN_DATA_BFLOAT16, CUDA_R_16BF, 2, false};
    throw std::runtime_error("unknown --dtype " + dtype);
  }
  bool tensor_cores() const { return storage != Storage::F32 || tf32; }
};

// fp32 host values to/from the storage type, rounding to nearest even (what PyTorch's .to(dtype) does).
std::vector<uint8_t> encode(const std::vector<float>& values, Storage storage);
std::vector<float> decode(const void* data, size_t count, Storage storage);

// Every byte the rung takes with cudaMalloc goes through DeviceBuffer, so the memory report is exact.
struct Ledger {
  size_t live = 0, peak = 0;
  static Ledger& get() { static Ledger l; return l; }
};

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    LADDER_CUDA(cudaMalloc(&ptr_, bytes));
    // No uninitialised reads, even while autotuning. cudaMemset runs on the legacy stream, which the rung's
    // non-blocking stream does not wait for: done before any kernel can read the buffer.
    LADDER_CUDA(cudaMemset(ptr_, 0, bytes));
    LADDER_CUDA(cudaDeviceSynchronize());
    Ledger& l = Ledger::get();
    l.live += bytes;
    l.peak = std::max(l.peak, l.live);
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept { *this = std::move(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr_) { cudaFree(ptr_); Ledger::get().live -= bytes_; }
  }
  void* get() const { return ptr_; }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Scratch workspace for autotuning: grows to the largest candidate tried, freed when the build is done.
class TuningWorkspace {
 public:
  explicit TuningWorkspace(size_t limit) : limit_(limit) {}
  size_t limit() const { return limit_; }
  void* ensure(size_t bytes) {
    if (bytes > buf_.bytes()) buf_ = DeviceBuffer(bytes);
    return buf_.get();
  }
 private:
  size_t limit_;
  DeviceBuffer buf_;
};

// Host to device in `stream`'s order, complete on return. A plain cudaMemcpy from pageable memory may return
// before its DMA lands, on the legacy stream, which a non-blocking stream does not wait for: a kernel on `stream`
// could read the old bytes (the training rung's next batch came in partly stale).
inline void upload(void* dst, const void* src, size_t bytes, cudaStream_t stream) {
  LADDER_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream));
  LADDER_CUDA(cudaStreamSynchronize(stream));
}

inline size_t align_up(size_t n, size_t a = 256) { return (n + a - 1) / a * a; }

// Median time of `reps` calls of fn on `stream`, each bracketed by CUDA events, after `warm` untimed calls.
inline double median_ms(cudaStream_t stream, const std::function<void()>& fn, int reps, int warm = 2) {
  for (int i = 0; i < warm; ++i) fn();
  cudaEvent_t a, b;
  LADDER_CUDA(cudaEventCreate(&a));
  LADDER_CUDA(cudaEventCreate(&b));
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    LADDER_CUDA(cudaEventRecord(a, stream));
    fn();
    LADDER_CUDA(cudaEventRecord(b, stream));
    LADDER_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    LADDER_CUDA(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ladder::median_of(t);
}

// fn's work on `stream` captured as one CUDA graph and instantiated; `nodes`, if given, gets the graph's node count.
// Throws if fn does something a capture does not allow; the stream leaves capture mode either way.
inline cudaGraphExec_t capture_graph(cudaStream_t stream, const std::function<void()>& fn, size_t* nodes = nullptr) {
  cudaGraph_t graph = nullptr;
  LADDER_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  try {
    fn();
  } catch (...) {
    if (cudaStreamEndCapture(stream, &graph) == cudaSuccess && graph) cudaGraphDestroy(graph);
    throw;
  }
  LADDER_CUDA(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec = nullptr;
  const cudaError_t made = cudaGraphInstantiate(&exec, graph, 0);
  if (made == cudaSuccess && nodes) LADDER_CUDA(cudaGraphGetNodes(graph, nullptr, nodes));
  cudaGraphDestroy(graph);
  LADDER_CUDA(made);
  return exec;
}

// Median GPU time of one call of fn, from replays of a CUDA graph of `calls` calls back to back: no host time before
// or between them, as in a captured forward. (median_ms of one call counts the host's work before its first kernel
// starts: at batch 1 that is most of a convolution's 15 us, its kernel 4 us.) -1 if fn cannot be captured.
inline double graph_ms(cudaStream_t stream, const std::function<void()>& fn, int calls, int reps) {
  cudaGraphExec_t exec = nullptr;
  try {
    exec = capture_graph(stream, [&] {
      for (int i = 0; i < calls; ++i) fn();
    });
  } catch (const std::exception&) {
    (void)cudaGetLastError();  // the failed capture's error is not this process's
    return -1;
  }
  const double ms = median_ms(stream, [&] { LADDER_CUDA(cudaGraphLaunch(exec, stream)); }, reps, 1) / calls;
  cudaGraphExecDestroy(exec);
  return ms;
}

}  // namespace rung
