// torchvision's ResNet-50 training step (core/train.py make_step), by hand: BatchNorm in training mode, cross-entropy,
// the whole backward, and SGD with momentum and weight decay. Convolutions in their three passes by cuDNN's graph API
// (conv.h), pooling and its backward by cuDNN, the classifier and its gradients by cuBLASLt (linear.h), the rest by
// our kernels (training_kernels.h, pool_kernels.h). NHWC. bf16 and fp16 keep fp32 master weights, BatchNorm parameters and statistics,
// as autocast does; every activation and gradient of the step lives in one memory plan (memory_plan.h).
#pragma once
#include <array>
#include <memory>
#include <string>
#include <vector>

#include "conv.h"
#include "linear.h"
#include "net.h"
#include "training_kernels.h"

namespace rung {

class ResNet50Train : public Network {
 public:
  ResNet50Train(const NetOptions& o, float lr, const ladder::TensorMap& weights, const ladder::HostTensor& input,
                cudaStream_t stream, ladder::Json& stats);
  ~ResNet50Train() override;

  void issue() const override;  // one training step, asynchronously on the stream
  size_t step_count() const override { return steps_.size(); }
  std::pair<std::string, std::string> step_layer(size_t i) const override;
  void issue_step(size_t i) const override { run(steps_[i]); }
  void* input() const override { return input_.get(); }
  size_t input_bytes() const override { return input_.bytes(); }
  void* output() const override { return loss_.get(); }  // the last step's loss (fp32)
  size_t output_bytes() const override { return sizeof(float); }
  ladder::TensorMap result(int steps) const override;  // the first `steps` losses, then state()
  ladder::TensorMap state() const override;  // parameters and running statistics as core/train.py state_of
  void set_batch(const ladder::HostTensor& x, const std::vector<int>& labels) override;
  void set_learning_rate(float lr) override { lr_ = lr; }  // read by the next steps' SGD launch
  void report_memory(ladder::Json& memory) const override;
  ladder::Json micro(int reps) const override;  // each step of the schedule timed alone
  void reset() override;  // the run's weights and statistics again, zero momentum, no step counted

 private:
  struct Tensor {  // an activation or a gradient of the batch: [batch, h, w, c] in the storage type
    int c, h, w;
    void* ptr = nullptr;
    size_t bytes = 0;  // nonzero: a buffer of these bytes (statistics, max-pool positions, a convolution's workspace)
  };
  struct Param;
  struct ConvUnit;
  struct BnUnit;
  struct PoolUnit;
  enum class Kind { ConvFprop, ConvDgrad, ConvWgrad, BnForward, BnBackward, PoolForward, PoolBackward, FcForward,
                    FcDgrad, FcWgrad, FcBias, Loss, Sgd };
  struct Step {
    Kind kind;
    int unit;  // into convs_, bns_ or pools_
    std::vector<int> reads, writes;
    std::vector<std::pair<int, int>> in_place = {};  // (output, input) it may compute in place (memory_plan.h)
  };

  int tensor(int c, int h, int w);
  int buffer(size_t bytes);
  int param(const std::string& name, std::vector<int64_t> shape, bool low_precision_copy, int padded_channels = 0);
  int conv(const std::string& name, int x, int k, int r, int stride, int pad);
  int bn(const std::string& name, int x, bool relu, int z = -1);
  int pool(int x, bool max, int window, int stride, int pad);
  int conv_backward(int unit, int dy, bool data, int dx_plus = -1);
  int bn_backward(int unit, int dy);
  int pool_backward(int unit, int dy);
  void run(const Step& s) const;
  std::string step_name(const Step& s) const;
  void place_parameters(const ladder::TensorMap& weights);
  void upload_input(const ladder::HostTensor& x);  // fp32 NCHW into the input buffer: storage type, NHWC, padded
  void place_activations(ladder::Json& memory_plan);
  void* weights_of(int param) const;
  void* grad_of(int param) const;
  std::array<ConvIO, 3> conv_io(const ConvUnit& u) const;  // by Pass
  ConvSpec conv_spec(const ConvUnit& u, Pass pass) const;
  static int conv_pass(Kind k);
  // The micro's probe of MLPerf's norm-conv (issue 59): pass `pass` of u run with the BatchNorm b's apply and ReLU in
  // its prologue, reading b's input, tuned; one row (micro() adds the steps it would replace).
  ladder::Json norm_prologue_row(const ConvUnit& u, const BnUnit& b, Pass pass, int reps) const;
  void tune_convolutions(ladder::Json& stats);
  void build_kernels(ladder::Json& stats);

  NetOptions o_;
  float lr_;
  cudaStream_t stream_;
  cudnnHandle_t handle_ = nullptr;
  int c_in_;  // the stem's input channels (3, zero-padded to 16 bytes for tensor cores)
  int x0_ = -1;  // the input's tensor (its own buffer, outside the plan)
  int classes_;  // the classifier's outputs, as the weights file's fc.weight has them
  std::vector<Tensor> tensors_;
  std::vector<Param> params_;
  std::vector<ConvUnit> convs_;
  std::vector<BnUnit> bns_;
  std::vector<std::unique_ptr<PoolUnit>> pools_;
  std::vector<Step> steps_;
  int fc_w_ = -1, fc_b_ = -1, pooled_ = -1, logits_ = -1, dlogits_ = -1, dpooled_ = -1;
  std::unique_ptr<Gemm> fc_forward_, fc_dgrad_, fc_wgrad_;
  std::unique_ptr<Sgd> sgd_;
  size_t bn_scratch_floats_ = 0;
  int max_channels_ = 0;
  DeviceBuffer master_, momentum_, grads_, copies_, bn_state_, bn_scratch_, activations_, workspace_, input_, loss_;
  DeviceBuffer labels_;  // int32 per row: core/train.py labels until set_batch
  std::vector<float> initial_master_, initial_bn_state_;  // for reset()
  std::vector<uint8_t> initial_copies_;
  float *row_loss_ = nullptr, *history_ = nullptr;
  int* count_ = nullptr;
};

}  // namespace rung
