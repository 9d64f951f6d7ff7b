// The storage types of a run as CUDA types: conversions through fp32 and a dispatch from Storage to the type.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.h"

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

}  // namespace rung
