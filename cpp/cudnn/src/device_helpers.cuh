// What the rung's kernels share on the device: the storage types as CUDA types (conversions through fp32, a
// dispatch from Storage to the type), the block size, and 16-byte packs of 8 neighbouring channels.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "precision.h"

namespace rung {

template <typename T> __host__ __device__ T from_float(float v);
template <> inline __host__ __device__ float from_float<float>(float v) { return v; }
template <> inline __host__ __device__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> inline __host__ __device__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

__host__ __device__ inline float to_float(float v) { return v; }
__host__ __device__ inline float to_float(__half v) { return __half2float(v); }
__host__ __device__ inline float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

// Calls f with a value of the C++ type that stores `storage`.
template <typename F> void with_type(Storage storage, F&& f) {
  switch (storage) {
    case Storage::F32: f(float{}); break;
    case Storage::F16: f(__half{}); break;
    case Storage::BF16: f(__nv_bfloat16{}); break;
  }
}

constexpr int kThreads = 256;
inline unsigned blocks_for(size_t total) { return static_cast<unsigned>((total + kThreads - 1) / kThreads); }

// Vectorised elementwise passes: 8 neighbouring channels per thread (16 bytes in 16 bits); every channel count of
// ResNet-50 is a multiple of 8 and every buffer 256-byte aligned.
constexpr int kVec = 8;

template <typename T>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};

template <typename T>
__device__ Pack<T> load_pack(const T* base, size_t pack) {
  return reinterpret_cast<const Pack<T>*>(base)[pack];
}

template <typename T>
__device__ void store_pack(T* base, size_t pack, const Pack<T>& v) {
  reinterpret_cast<Pack<T>*>(base)[pack] = v;
}

}  // namespace rung
