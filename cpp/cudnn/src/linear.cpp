#include "linear.h"

#include "checks.h"
#include "gpu_timing.h"

namespace rung {

Gemm::Gemm(const Precision& p, GemmShape shape, const void* a, const void* b, void* c, const void* bias,
           TuningWorkspace& ws, cudaStream_t stream)
    : shape_(shape), a_ptr_(a), b_ptr_(b), c_ptr_(c), bias_(bias != nullptr) {
  // fp32 accumulation always; TF32 only where the dtype allows it.
  compute_ = p.tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  CUBLAS_CHECK(cublasLtCreate(&lt_));
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&op_, compute_, CUDA_R_32F));
  cublasOperation_t ta = shape.transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasOperation_t tb = shape.transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  if (bias) {
    cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;  // bias per row of C
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof epilogue));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias));
  }
  // The stored matrices, before op(): A is k x m when transposed, else m x k; B is n x k when transposed, else k x n.
  const GemmShape& s = shape;
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&a_, p.cuda, s.transpose_a ? s.k : s.m, s.transpose_a ? s.m : s.k, s.lda));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&b_, p.cuda, s.transpose_b ? s.n : s.k, s.transpose_b ? s.k : s.n, s.ldb));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&c_, p.cuda, s.m, s.n, s.ldc));

  cublasLtMatmulPreference_t pref;
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  uint64_t limit = ws.limit();
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &limit,
                                                    sizeof limit));
  cublasLtMatmulHeuristicResult_t found[8];
  int n = 0;
  CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(lt_, op_, a_, b_, c_, c_, pref, 8, found, &n));
  cublasLtMatmulPreferenceDestroy(pref);
  for (int i = 0; i < n; ++i) {
    if (found[i].state != CUBLAS_STATUS_SUCCESS) continue;
    void* scratch = ws.ensure(found[i].workspaceSize);
    double ms = median_ms(stream, [&] { matmul(scratch, stream, found[i].algo, found[i].workspaceSize); }, 5);
    ++tried_;
    if (tried_ > 1 && ms >= tuned_ms_) continue;
    tuned_ms_ = ms;
    algo_ = found[i].algo;
    workspace_ = found[i].workspaceSize;
  }
  if (!tried_)
    throw std::runtime_error("cuBLASLt has no algorithm for a " + std::to_string(s.m) + "x" + std::to_string(s.n) +
                             "x" + std::to_string(s.k) + " product in " + p.name);
}

Gemm::~Gemm() {
  if (c_) cublasLtMatrixLayoutDestroy(c_);
  if (b_) cublasLtMatrixLayoutDestroy(b_);
  if (a_) cublasLtMatrixLayoutDestroy(a_);
  if (op_) cublasLtMatmulDescDestroy(op_);
  if (lt_) cublasLtDestroy(lt_);
}

void Gemm::matmul(void* ws, cudaStream_t stream, const cublasLtMatmulAlgo_t& algo, size_t ws_bytes) const {
  const float alpha = 1.f, beta = 0.f;
  CUBLAS_CHECK(cublasLtMatmul(lt_, op_, &alpha, a_ptr_, a_, b_ptr_, b_, &beta, c_ptr_, c_, c_ptr_, c_, &algo, ws,
                              ws_bytes, stream));
}

void Gemm::run(cudaStream_t stream) const { matmul(ws_, stream, algo_, workspace_); }

ladder::Json Gemm::stats() const {
  int id = -1, tile = -1;
  size_t written = 0;
  CUBLAS_CHECK(cublasLtMatmulAlgoConfigGetAttribute(&algo_, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof id, &written));
  CUBLAS_CHECK(cublasLtMatmulAlgoConfigGetAttribute(&algo_, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof tile, &written));
  ladder::Json j = ladder::Json::object();
  j["algo"] = id;
  j["tile"] = tile;
  j["compute"] = compute_ == CUBLAS_COMPUTE_32F_FAST_TF32 ? "32F_FAST_TF32" : "32F";
  j["epilogue"] = bias_ ? "bias" : "none";
  j["workspace_bytes"] = static_cast<unsigned long long>(workspace_);
  j["candidates_timed"] = tried_;
  j["tuned_ms"] = tuned_ms_;
  return j;
}

}  // namespace rung
