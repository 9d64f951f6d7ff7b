// torchvision's ResNet-50 (eval mode) as cuDNN fused convolutions with batch-norm folded in (on tensor cores the
// stem between tiled layouts, stem.h), pooling (cuDNN's, or our max-pool in NHWC) and a cuBLASLt classifier, over an
// explicit activation memory plan (memory_plan.h).
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "conv.h"
#include "device_memory.h"
#include "linear.h"
#include "precision.h"

namespace rung {

constexpr double kBnEps = 1e-5;  // torchvision's BatchNorm2d default

using ladder::shape_str;
// The named tensor of the weights file, checked against the shape torchvision's resnet50 gives it.
const ladder::HostTensor& weight(const ladder::TensorMap& w, const std::string& name,
                                 const std::vector<int64_t>& shape);

// What the rung's driver needs of a network: one call (a forward, or a training step) issued on the stream, its
// device input and output, and what goes into the cell's output file.
class Network {
 public:
  virtual ~Network() = default;
  virtual void issue() const = 0;
  virtual void* input() const = 0;
  virtual size_t input_bytes() const = 0;
  virtual void* output() const = 0;
  virtual size_t output_bytes() const = 0;
  virtual ladder::TensorMap result(int steps) const = 0;  // synchronises
  virtual void report_memory(ladder::Json& memory) const = 0;
  virtual ladder::Json micro(int reps) const = 0;
  virtual void reset() {}  // back to the state the build left: undoes what calls changed (a training step's update)
  // Training on data (ladder::Rung::set_batch, set_learning_rate, state): the next steps' input, labels and rate;
  // the state after them.
  virtual void set_batch(const ladder::HostTensor& x, const std::vector<int>& labels) {
    (void)x, (void)labels;
    throw std::runtime_error("the cudnn rung's forward does not train");
  }
  virtual void set_learning_rate(float lr) {
    (void)lr;
    throw std::runtime_error("the cudnn rung's forward does not train");
  }
  virtual ladder::TensorMap state() const { throw std::runtime_error("the cudnn rung's forward has no training state"); }
  // The census (ladder::Rung::census): issue() as its steps, one at a time, each with the module path of the layer
  // it computes ("layer1.0.conv2"; "loss", "optimizer") and its pass ("forward", "backward", "optimizer").
  virtual size_t step_count() const = 0;
  virtual std::pair<std::string, std::string> step_layer(size_t i) const = 0;
  virtual void issue_step(size_t i) const = 0;
};

// A cuDNN pooling of one activation shape: max (padding ignored: PyTorch pads with -inf) or average (no padding).
struct PoolDesc {
  PoolDesc(bool max, int window, int stride, int pad, const Precision& p, bool nhwc, int n, int c, int h, int w);
  ~PoolDesc();
  PoolDesc(const PoolDesc&) = delete;
  PoolDesc& operator=(const PoolDesc&) = delete;
  int out_h, out_w;
  cudnnPoolingDescriptor_t desc = nullptr;
  cudnnTensorDescriptor_t x = nullptr, y = nullptr;
};

struct NetOptions {
  int batch, res;
  Precision precision;
  bool nhwc;              // activations NHWC (always for fp16/bf16) or NCHW
  EngineSearch search;    // how each distinct convolution's engine configuration is searched
  size_t workspace_limit; // the most workspace one candidate may ask for
  std::vector<std::string> engine_tables;  // engine choices to reuse (shipped for this GPU, the run's own), read
  std::string engine_table_out;            // where choices tuned here are appended ("" = nowhere)
  EngineOptions engine() const {
    return {&precision, nhwc, search, workspace_limit, engine_tables, engine_table_out};
  }
};

class ResNet50 : public Network {
 public:
  ResNet50(const NetOptions& o, const ladder::TensorMap& weights, const ladder::HostTensor& input, cudaStream_t stream,
           ladder::Json& stats);
  ~ResNet50() override;
  ResNet50(const ResNet50&) = delete;
  ResNet50& operator=(const ResNet50&) = delete;

  void issue() const override;  // one forward pass, asynchronously on the stream
  size_t step_count() const override { return steps_.size(); }
  std::pair<std::string, std::string> step_layer(size_t i) const override;
  void issue_step(size_t i) const override;
  void* input() const override { return input_.get(); }
  size_t input_bytes() const override { return input_.bytes(); }
  void* output() const override { return output_.get(); }
  size_t output_bytes() const override { return output_.bytes(); }
  ladder::TensorMap result(int steps) const override;  // the logits, as fp32 "output"
  void report_memory(ladder::Json& memory) const override;
  ladder::Json micro(int reps) const override;  // each distinct convolution timed alone

 private:
  struct Act {      // one activation of the batch
    int c, h, w;
    int tile = 1;   // stored in tile x tile pixel tiles, [n][h / tile][w / tile][tile][tile][c] (the tiled stem's)
    void* ptr = nullptr;
  };
  struct ConvDef {  // a convolution before tuning: where its weights come from and what it reads and writes
    std::string name, bn;
    int in, out, residual;
    ConvSpec spec;
  };
  struct Pool;      // a pooling step
  struct Step {
    enum Kind { Conv, Pooling, Fc } kind;
    int index;             // into convs_ / pools_
    std::vector<int> reads;
    int writes;
  };

  int add_conv(const std::string& conv, const std::string& bn, int in, int k, int r, int stride, int pad, Epilogue e,
               int residual = -1, int out_tile = 1);
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
