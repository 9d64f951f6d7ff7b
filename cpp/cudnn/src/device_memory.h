// Device memory, accounted: every cudaMalloc of the rung through DeviceBuffer (the memory report is exact), the
// autotuner's scratch workspace, and ordered uploads.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <utility>

#include "ladder/protocol.h"  // LADDER_CUDA

namespace rung {

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

}  // namespace rung
