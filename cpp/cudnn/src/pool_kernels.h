// Max-pooling in our own CUDA, for the inference forward and the training step.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "precision.h"

namespace rung {

// Max-pooling, NHWC (PyTorch's: padding never wins, the first maximum in the window's row-major order does). In
// training the forward keeps, per output element, its window position (one byte; inference passes where = nullptr);
// the backward gathers, for each input, the gradients of the outputs whose maximum it was: no atomics, so
// deterministic. cuDNN's pooling backward, which rereads x and y, took 1.5 ms of an H200's bf16 batch-256 step for
// this one layer.
struct PoolShape {
  int n, c, h, w, window, stride, pad, out_h, out_w;
};
// tiled: x is stored in 2x2 pixel tiles (net.h Act::tile, the tiled stem's output); y never is.
void max_pool_forward(const void* x, void* y, uint8_t* where, Storage st, const PoolShape& s, bool tiled,
                      cudaStream_t stream);
void max_pool_backward(const void* dy, const uint8_t* where, void* dx, Storage st, const PoolShape& s,
                       cudaStream_t stream);

}  // namespace rung
