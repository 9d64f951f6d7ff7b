// Matrix products by cuBLASLt, column-major as cuBLAS sees them, with an optional bias epilogue; the algorithm is the
// fastest of the heuristic's candidates, timed at build. The classifier's forward is one (Linear); training adds its
// data and weight gradients.
#pragma once
#include <cublasLt.h>

#include "device_memory.h"
#include "precision.h"

namespace rung {

// C[m, n] = op(A) op(B) (+ bias per row of C), every matrix column-major in the storage type, fp32 accumulation.
struct GemmShape {
  bool transpose_a, transpose_b;
  int m, n, k;
  int lda, ldb, ldc;
};

class Gemm {
 public:
  Gemm(const Precision& p, GemmShape shape, const void* a, const void* b, void* c, const void* bias,
       TuningWorkspace& ws, cudaStream_t stream);
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;
  size_t workspace() const { return workspace_; }
  void bind(void* workspace) { ws_ = workspace; }
  void run(cudaStream_t stream) const;
  double flops() const { return 2.0 * shape_.m * shape_.n * shape_.k; }
  ladder::Json stats() const;

 private:
  void matmul(void* ws, cudaStream_t stream, const cublasLtMatmulAlgo_t& algo, size_t ws_bytes) const;
  GemmShape shape_;
  const void *a_ptr_, *b_ptr_;
  void* c_ptr_;
  bool bias_;
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

// The classifier y[N, out] = x[N, in] W^T + b. w: [out, in] row-major (PyTorch's layout), bias [out], x [batch, in],
// y [batch, out]: seen column-major, y^T[out, N] = (W as [in, out])^T x^T[in, N].
class Linear : public Gemm {
 public:
  Linear(const Precision& p, int batch, int in, int out, const void* w, const void* bias, const void* x, void* y,
         TuningWorkspace& ws, cudaStream_t stream)
      : Gemm(p, {true, false, out, batch, in, in, in, out}, w, x, y, bias, ws, stream) {}
};

}  // namespace rung
