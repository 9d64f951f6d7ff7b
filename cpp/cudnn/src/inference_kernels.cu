#include "inference_kernels.h"

#include "device_helpers.cuh"
#include "ladder/protocol.h"  // LADDER_CUDA

namespace rung {
namespace {

template <typename T>
__global__ void nchw_to_nhwc_kernel(const float* __restrict__ src, T* __restrict__ dst, int n, int c, int h, int w,
                                    InputLayout to) {
  size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  size_t total = size_t(n) * to.out_h * to.out_w * to.c_pad;
  if (i >= total) return;
  const int ch = static_cast<int>(i % to.c_pad);
  const size_t pixel = i / to.c_pad;  // (b, y, x) flattened
  const int x = static_cast<int>(pixel % to.out_w), y = static_cast<int>(pixel / to.out_w % to.out_h);
  const size_t b = pixel / to.out_w / to.out_h;
  int from, sy, sx;
  const bool inside = to.source(y, x, ch, c, h, w, from, sy, sx);
  dst[i] = from_float<T>(inside ? src[((b * c + from) * h + sy) * w + sx] : 0.f);
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

// The same, 16 bytes per thread (4 fp32 or 8 16-bit elements): one vector load of y and of z, one store, and the
// index arithmetic once per vector. Used where every pointer is 16-byte aligned and `total` a multiple of V.
template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

template <typename T, int V>
__global__ void bias_add_relu_vec_kernel(T* __restrict__ y, const T* __restrict__ bias, const T* __restrict__ z,
                                         bool relu, size_t total, int channels, size_t inner) {
  const size_t i = (blockIdx.x * size_t(blockDim.x) + threadIdx.x) * V;
  if (i >= total) return;
  Vec<T, V> a = *reinterpret_cast<const Vec<T, V>*>(y + i);
  Vec<T, V> r{};
  if (z) r = *reinterpret_cast<const Vec<T, V>*>(z + i);
  size_t c = (i / inner) % channels;  // the channel of element i; it advances every `inner` elements
  size_t left = inner - i % inner;    // elements before it does
#pragma unroll
  for (int k = 0; k < V; ++k) {
    float v = to_float(a.v[k]) + to_float(bias[c]);
    if (z) v += to_float(r.v[k]);
    if (relu) v = fmaxf(v, 0.f);
    a.v[k] = from_float<T>(v);
    if (--left == 0) {
      c = c + 1 == size_t(channels) ? 0 : c + 1;
      left = inner;
    }
  }
  *reinterpret_cast<Vec<T, V>*>(y + i) = a;
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

void nchw_to_nhwc(const float* src, void* dst, Storage storage, int n, int c, int h, int w, const InputLayout& to,
                  cudaStream_t stream) {
  size_t total = size_t(n) * to.out_h * to.out_w * to.c_pad;
  with_type(storage, [&](auto t) {
    using T = decltype(t);
    nchw_to_nhwc_kernel<T><<<blocks_for(total), kThreads, 0, stream>>>(src, static_cast<T*>(dst), n, c, h, w, to);
  });
  LADDER_CUDA(cudaGetLastError());
}

void bias_add_relu(void* y, const void* bias, const void* z, bool relu, Storage storage, size_t total, int channels,
                   size_t inner, cudaStream_t stream) {
  with_type(storage, [&](auto t) {
    using T = decltype(t);
    constexpr int V = 16 / sizeof(T);
    if (total % V == 0 && aligned16(y) && (!z || aligned16(z))) {
      bias_add_relu_vec_kernel<T, V><<<blocks_for(total / V), kThreads, 0, stream>>>(
          static_cast<T*>(y), static_cast<const T*>(bias), static_cast<const T*>(z), relu, total, channels, inner);
    } else {
      bias_add_relu_kernel<T><<<blocks_for(total), kThreads, 0, stream>>>(
          static_cast<T*>(y), static_cast<const T*>(bias), static_cast<const T*>(z), relu, total, channels, inner);
    }
  });
  LADDER_CUDA(cudaGetLastError());
}

}  // namespace rung
