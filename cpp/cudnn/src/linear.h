// The classifier y[N, out] = x[N, in] W^T + b by cuBLASLt with the bias as its epilogue; the algorithm is the
// fastest of the heuristic's candidates, timed at build.
#pragma once
#include "common.h"

namespace rung {

class Linear {
 public:
  // w: [out, in] row-major (PyTorch's layout), bias [out], x [batch, in], y [batch, out], all in the storage type.
  Linear(const Precision& p, int batch, int in, int out, const void* w, const void* bias, const void* x, void* y,
         TuningWorkspace& ws, cudaStream_t stream);
  ~Linear();
  Linear(const Linear&) = delete;
  Linear& operator=(const Linear&) = delete;
  size_t workspace() const { return workspace_; }
  void bind(void* workspace) { ws_ = workspace; }
  void run(cudaStream_t stream) const;
  ladder::Json stats() const;

 private:
  void matmul(void* ws, cudaStream_t stream, const cublasLtMatmulAlgo_t& algo, size_t ws_bytes) const;
  const void *w_, *x_;
  void* y_;
  cublasLtHandle_t lt_ = nullptr;
  cublasLtMatmulDesc_t op_ = nullptr;
  cublasLtMatrixLayout_t a_ = nullptr, b_ = nullptr, c_ = nullptr;
  cublasComputeType_t compute_;
  cublasLtMatmulAlgo_t algo_{};
  size_t workspace_ = 0;
  void* ws_ = nullptr;
  int tried_ = 0;
  double tuned_ms_ = 0;
};

}  // namespace rung
