// Our own CUDA, only where cuDNN has nothing fused for the job.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>

#include "common.h"

namespace rung {

// The contract's fp32 NCHW input to NHWC in the storage type (done once at build): `pad` zero pixels on each
// border, then each `block` x `block` tile of pixels folded into one pixel's channels (space-to-depth; block 1: plain
// NHWC), channel (u * block + v) * c + i holding channel i of the tile's pixel (u, v); channels zero-padded to c_pad.
// The output is [n, out_h, out_w, c_pad]; pixels past the padded image are zero. Zero channels and pixels meet zero
// filter taps, so the convolution's result is unchanged.
struct InputLayout {
  int pad = 0, block = 1, out_h, out_w, c_pad;
};
void nchw_to_nhwc(const float* src, void* dst, Storage storage, int n, int c, int h, int w, const InputLayout& to,
                  cudaStream_t stream);

// y = [relu](y + bias[channel] [+ z]) in place: the epilogue of a convolution whose engine could not fuse it.
// The channel of flat index i is (i / inner) % channels (inner = 1 for NHWC, H*W for NCHW).
void bias_add_relu(void* y, const void* bias, const void* z, bool relu, Storage storage, size_t total, int channels,
                   size_t inner, cudaStream_t stream);

}  // namespace rung
