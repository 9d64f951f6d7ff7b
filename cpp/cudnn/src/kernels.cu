#include "kernels.h"
#include "typed.cuh"

namespace rung {
namespace {

template <typename T>
__global__ void nchw_to_nhwc_kernel(const float* __restrict__ src, T* __restrict__ dst, int n, int c, int h, int w,
                                    int c_pad) {
  size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  size_t total = size_t(n) * h * w * c_pad;
  if (i >= total) return;
  int ch = static_cast<int>(i % c_pad);
  size_t pixel = i / c_pad;  // (b, y, x) flattened
  size_t hw = size_t(h) * w;
  size_t b = pixel / hw, yx = pixel % hw;
  dst[i] = from_float<T>(ch < c ? src[(b * c + ch) * hw + yx] : 0.f);
}

template <typename T>
__global__ void bias_add_relu_kernel(T* __restrict__ y, const T* __restrict__ bias, const T* __restrict__ z,
                                     bool relu, size_t total, int channels, size_t inner) {
  size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  if (i >= total) return;
  float v = to_float(y[i]) + to_float(bias[(i / inner) % channels]);
  if (z) v += to_float(z[i]);
  if (relu) v = fmaxf(v, 0.f);
  y[i] = from_float<T>(v);
}

}  // namespace

void nchw_to_nhwc(const float* src, void* dst, Storage storage, int n, int c, int h, int w, int c_pad,
                  cudaStream_t stream) {
  size_t total = size_t(n) * h * w * c_pad;
  with_type(storage, [&](auto t) {
    using T = decltype(t);
    nchw_to_nhwc_kernel<T><<<blocks_for(total), kThreads, 0, stream>>>(src, static_cast<T*>(dst), n, c, h, w, c_pad);
  });
  LADDER_CUDA(cudaGetLastError());
}

void bias_add_relu(void* y, const void* bias, const void* z, bool relu, Storage storage, size_t total, int channels,
                   size_t inner, cudaStream_t stream) {
  with_type(storage, [&](auto t) {
    using T = decltype(t);
    bias_add_relu_kernel<T><<<blocks_for(total), kThreads, 0, stream>>>(
        static_cast<T*>(y), static_cast<const T*>(bias), static_cast<const T*>(z), relu, total, channels, inner);
  });
  LADDER_CUDA(cudaGetLastError());
}

std::vector<uint8_t> encode(const std::vector<float>& values, Storage storage) {
  std::vector<uint8_t> out;
  with_type(storage, [&](auto t) {
    using T = decltype(t);
    out.resize(values.size() * sizeof(T));
    T* p = reinterpret_cast<T*>(out.data());
    for (size_t i = 0; i < values.size(); ++i) p[i] = from_float<T>(values[i]);
  });
  return out;
}

std::vector<float> decode(const void* data, size_t count, Storage storage) {
  std::vector<float> out(count);
  with_type(storage, [&](auto t) {
    using T = decltype(t);
    const T* p = static_cast<const T*>(data);
    for (size_t i = 0; i < count; ++i) out[i] = to_float(p[i]);
  });
  return out;
}

}  // namespace rung
