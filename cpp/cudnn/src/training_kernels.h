// The CUDA of our own that the training step needs besides cuDNN and cuBLASLt (the max-pool is pool_kernels.h):
// BatchNorm in training mode (forward and backward, ReLU and the residual add fused into them), the loss, the classifier's bias gradient, a gradient sum,
// and SGD over every parameter in one launch. Activations are NHWC, seen as [rows = N*H*W, C]; every statistic and
// sum is fp32 (per-thread Welford, combined in fp64), whatever the storage type.
#pragma once
#include <cstdint>
#include <vector>

#include "device_memory.h"
#include "precision.h"

namespace rung {

// Per-channel partial sums of a BatchNorm pass: blocks over the rows (`groups`) x channels, 3 floats each.
struct BnGrid {
  int groups;
  static BnGrid for_shape(int64_t rows, int channels);
  size_t scratch_floats(int channels) const { return size_t(groups) * channels * 3; }
};

// BatchNorm's batch statistics of x, by our pass (per-thread Welford): its partial sums, BnGrid::for_shape's groups x
// channels x 3 floats. The convolution before the BatchNorm runs it where cuDNN's genstats does not (conv.h).
void bn_statistics(const void* x, Storage st, int64_t rows, int channels, float* partial, cudaStream_t stream);

// Forward, training mode, from x's batch statistics `stats`: cuDNN genstats' sum and sum of squares per channel
// ([2][channels]) where `sums`, else bn_statistics' partials. Saves mean and 1/sqrt(var + eps) for the backward,
// updates the running statistics as PyTorch does (unbiased variance, `momentum`), then y = [relu](x * scale + shift
// [+ z]).
void bn_forward(const void* x, const void* z, void* y, bool relu, Storage st, int64_t rows, int channels,
                const float* stats, bool sums, const float* gamma, const float* beta, float* running_mean,
                float* running_var, float momentum, float eps, float* save_mean, float* save_invstd,
                float* scale_shift, cudaStream_t stream);

// Floats per channel of bn_backward's `coef` (bn_forward's `scale_shift`, the backward's `affine`, takes 2).
constexpr int kBnCoefs = 3;

// Backward from dy (the gradient of y): dy' = dy masked by the forward's ReLU, read from y where y is given (the
// forward added z before the ReLU), else recomputed from x with the forward's `affine` scale and shift where that is
// given (y need not be read), else no ReLU; dz = dy' where the forward added z; dgamma = sum(dy' * xhat),
// dbeta = sum(dy'); dx = gamma * invstd * (dy' - mean(dy') - xhat * mean(dy' * xhat)). dx may be dy (in place).
void bn_backward(const void* dy, const void* y, const float* affine, const void* x, void* dx, void* dz, Storage st,
                 int64_t rows, int channels, const float* gamma, const float* save_mean, const float* save_invstd,
                 float* dgamma, float* dbeta, float* coef, float* scratch, BnGrid grid, cudaStream_t stream);

// Softmax cross-entropy against core/train.py's labels ((i * 7919) % classes), mean over the batch: dlogits =
// (softmax - onehot) / batch in the storage type; the step's loss goes to last_loss and, while *count < capacity,
// to history[*count] (then *count advances: the losses of the first steps stay, in a CUDA graph too).
void cross_entropy(const void* logits, const int* labels, void* dlogits, Storage st, int batch, int classes,
                   float* row_loss, float* last_loss, float* history, int* count, int capacity, cudaStream_t stream);

// db[j] = sum over the batch of dy[i, j] (the classifier's bias gradient), in the storage type.
void column_sum(const void* dy, void* db, Storage st, int batch, int classes, cudaStream_t stream);

// out = a + b (a residual's two gradients); out may be a.
void add(const void* a, const void* b, void* out, Storage st, size_t n, cudaStream_t stream);

// One parameter for SGD: fp32 master weights and momentum, its gradient (fp32 or the storage type), and the
// storage-type copy the forward reads (none in fp32).
struct SgdTensor {
  float* master;
  float* momentum;
  const void* grad;
  void* copy;
  int64_t n;
  Storage grad_type, copy_type;
};

// torch.optim.SGD's step (momentum, weight decay, no dampening, not Nesterov) over every tensor in one launch: the
// tensors are cut into chunks, one block each, from a table made once.
class Sgd {
 public:
  explicit Sgd(const std::vector<SgdTensor>& tensors);
  void step(float lr, float momentum, float weight_decay, cudaStream_t stream) const;

 private:
  DeviceBuffer tensors_, chunks_;
  int n_chunks_ = 0;
};

}  // namespace rung
