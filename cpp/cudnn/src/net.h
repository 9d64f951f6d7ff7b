// torchvision's ResNet-50 (eval mode) as cuDNN fused convolutions with batch-norm folded in, cuDNN pooling and a
// cuBLASLt classifier, over an explicit activation memory plan.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common.h"
#include "conv.h"
#include "linear.h"

namespace rung {

struct NetOptions {
  int batch, res;
  Precision precision;
  bool nhwc;              // activations NHWC (always for fp16/bf16) or NCHW
  int candidates;         // engine configurations timed per distinct convolution
  size_t workspace_limit; // the most workspace one candidate may ask for
  std::vector<std::string> engine_tables;  // engine choices to reuse (shipped for this GPU, the run's own), read
  std::string engine_table_out;            // where choices tuned here are appended ("" = nowhere)
};

class ResNet50 {
 public:
  ResNet50(const NetOptions& o, const ladder::TensorMap& weights, const ladder::HostTensor& input, cudaStream_t stream,
           ladder::Json& stats);
  ~ResNet50();
  ResNet50(const ResNet50&) = delete;
  ResNet50& operator=(const ResNet50&) = delete;

  void issue() const;  // one forward pass, asynchronously on the stream
  void* input() const { return input_.get(); }
  size_t input_bytes() const { return input_.bytes(); }
  void* output() const { return output_.get(); }
  size_t output_bytes() const { return output_.bytes(); }
  std::vector<float> output_fp32() const;  // synchronises
  void report_memory(ladder::Json& memory) const;
  ladder::Json micro(int reps) const;  // each distinct convolution timed alone

 private:
  struct Act {      // one activation of the batch
    int c, h, w;
    int last_use = -1;  // index of the last step that reads it
    void* ptr = nullptr;
  };
  struct ConvDef {  // a convolution before tuning: where its weights come from and what it reads and writes
    std::string name, bn;
    int in, out, residual;
    ConvSpec spec;
  };
  struct Pool;      // a cuDNN pooling step
  struct Step {
    enum Kind { Conv, Pooling, Fc } kind;
    int index;             // into convs_ / pools_
    std::vector<int> reads;
    int writes;
  };

  int add_conv(const std::string& conv, const std::string& bn, int in, int k, int r, int stride, int pad, Epilogue e,
               int residual = -1);
  int add_pool(int in, bool max, int window, int stride, int pad);
  void plan_memory(ladder::Json& stats);

  NetOptions o_;
  cudaStream_t stream_;
  cudnnHandle_t handle_ = nullptr;
  std::vector<Act> acts_;
  std::vector<ConvDef> defs_;
  std::vector<std::unique_ptr<Pool>> pools_;
  std::vector<Step> steps_;
  std::vector<ConvLayer> convs_;
  std::unique_ptr<Linear> fc_;
  DeviceBuffer weights_, activations_, workspace_, input_, output_;
};

}  // namespace rung
