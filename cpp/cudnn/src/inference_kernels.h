// The inference forward's own CUDA, only where cuDNN has nothing fused for the job: the input's layout, and a
// convolution's epilogue where its engine could not fuse it.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>

#include "precision.h"
#include "stem.h"

namespace rung {

// The contract's fp32 NCHW input in the storage type and `to`'s layout (stem.h), once at build.
void nchw_to_nhwc(const float* src, void* dst, Storage storage, int n, int c, int h, int w, const InputLayout& to,
                  cudaStream_t stream);

// y = [relu](y + bias[channel] [+ z]) in place: the epilogue of a convolution whose engine could not fuse it.
// The channel of flat index i is (i / inner) % channels (inner = 1 for NHWC, H*W for NCHW).
void bias_add_relu(void* y, const void* bias, const void* z, bool relu, Storage storage, size_t total, int channels,
                   size_t inner, cudaStream_t stream);

}  // namespace rung
