#include "pool_kernels.h"

#include <stdexcept>

#include "device_helpers.cuh"
#include "ladder/protocol.h"  // LADDER_CUDA
#include "stem.h"

namespace rung {
namespace {

// Max-pooling, 8 channels a thread (grid-stride over packs; NHWC, so a pack's 8 channels share one pixel).
struct PoolIndex {
  int b, y, x, lane;  // image, row, column (of the output in the forward, of the input in the backward), channel pack
  __device__ PoolIndex(size_t i, int lanes, int width, int height)
      : b(int(i / lanes / width / height)), y(int(i / lanes / width % height)), x(int(i / lanes % width)),
        lane(int(i % lanes)) {}
};

// Tiled: x stored in 2x2 pixel tiles (stem.h tiled_pixel).
template <typename T, bool Tiled>
__global__ void max_pool_forward_kernel(const T* __restrict__ x, T* __restrict__ y, uint64_t* __restrict__ where,
                                        PoolShape s) {
  const int lanes = s.c / kVec;
  const size_t packs = size_t(s.n) * s.out_h * s.out_w * lanes;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < packs; i += size_t(gridDim.x) * blockDim.x) {
    const PoolIndex o(i, lanes, s.out_w, s.out_h);
    const int top = o.y * s.stride - s.pad, left = o.x * s.stride - s.pad;
    const int r0 = max(0, -top), c0 = max(0, -left);
    float best[kVec];
    int at[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) best[j] = -INFINITY, at[j] = r0 * s.window + c0;  // the first position in x
    for (int r = r0; r < s.window && top + r < s.h; ++r)
      for (int c = c0; c < s.window && left + c < s.w; ++c) {
        const int row = top + r, col = left + c;
        const size_t pixel =
            Tiled ? tiled_pixel(o.b, row, col, s.h / 2, s.w / 2) : (size_t(o.b) * s.h + row) * s.w + col;
        const Pack<T> v = load_pack(x, pixel * lanes + o.lane);
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          const float f = to_float(v.v[j]);
          if (f > best[j] || isnan(f)) best[j] = f, at[j] = r * s.window + c;  // PyTorch's test
        }
      }
    Pack<T> out;
    uint64_t positions = 0;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      out.v[j] = from_float<T>(best[j]);
      positions |= uint64_t(at[j]) << (8 * j);
    }
    store_pack(y, i, out);
    if (where) where[i] = positions;
  }
}

template <typename T>
__global__ void max_pool_backward_kernel(const T* __restrict__ dy, const uint64_t* __restrict__ where,
                                         T* __restrict__ dx, PoolShape s) {
  const int lanes = s.c / kVec;
  const size_t packs = size_t(s.n) * s.h * s.w * lanes;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < packs; i += size_t(gridDim.x) * blockDim.x) {
    const PoolIndex in(i, lanes, s.w, s.h);
    // The outputs whose window holds this input: p * stride - pad <= row <= p * stride - pad + window - 1.
    const int rows_from = in.y + s.pad - s.window + 1, cols_from = in.x + s.pad - s.window + 1;
    const int p0 = rows_from <= 0 ? 0 : (rows_from + s.stride - 1) / s.stride;
    const int q0 = cols_from <= 0 ? 0 : (cols_from + s.stride - 1) / s.stride;
    const int p1 = min(s.out_h - 1, (in.y + s.pad) / s.stride), q1 = min(s.out_w - 1, (in.x + s.pad) / s.stride);
    float g[kVec] = {};
    for (int p = p0; p <= p1; ++p)
      for (int q = q0; q <= q1; ++q) {
        const size_t o = ((size_t(in.b) * s.out_h + p) * s.out_w + q) * lanes + in.lane;
        const uint64_t positions = where[o];
        const uint64_t mine = uint64_t((in.y - (p * s.stride - s.pad)) * s.window + in.x - (q * s.stride - s.pad));
        // Compare all 8 bytes at once: a byte of (positions ^ mine * 0x0101...) is zero where the maximum is ours.
        const uint64_t diff = positions ^ (mine * 0x0101010101010101ull);
        if (((diff - 0x0101010101010101ull) & ~diff & 0x8080808080808080ull) == 0) continue;  // no channel's
        const Pack<T> d = load_pack(dy, o);
#pragma unroll
        for (int j = 0; j < kVec; ++j)
          if (((diff >> (8 * j)) & 0xff) == 0) g[j] += to_float(d.v[j]);
      }
    Pack<T> out;
#pragma unroll
    for (int j = 0; j < kVec; ++j) out.v[j] = from_float<T>(g[j]);
    store_pack(dx, i, out);
  }
}

}  // namespace

static void check_pool(const PoolShape& s) {
  if (s.c % kVec) throw std::runtime_error("max-pooling kernels need a multiple of 8 channels");
  if (s.window * s.window > 256) throw std::runtime_error("max-pooling window over 16x16: positions need a byte");
}

void max_pool_forward(const void* x, void* y, uint8_t* where, Storage st, const PoolShape& s, bool tiled,
                      cudaStream_t stream) {
  check_pool(s);
  if (tiled && (s.h % 2 || s.w % 2)) throw std::runtime_error("a 2x2-tiled activation has an even height and width");
  const size_t packs = size_t(s.n) * s.out_h * s.out_w * (s.c / kVec);
  with_type(st, [&](auto t) {
    using T = decltype(t);
    auto kernel = tiled ? max_pool_forward_kernel<T, true> : max_pool_forward_kernel<T, false>;
    kernel<<<blocks_for(packs), kThreads, 0, stream>>>(static_cast<const T*>(x), static_cast<T*>(y),
                                                      reinterpret_cast<uint64_t*>(where), s);
  });
  LADDER_CUDA(cudaGetLastError());
}

void max_pool_backward(const void* dy, const uint8_t* where, void* dx, Storage st, const PoolShape& s,
                       cudaStream_t stream) {
  check_pool(s);
  const size_t packs = size_t(s.n) * s.h * s.w * (s.c / kVec);
  with_type(st, [&](auto t) {
    using T = decltype(t);
    max_pool_backward_kernel<T><<<blocks_for(packs), kThreads, 0, stream>>>(
        static_cast<const T*>(dy), reinterpret_cast<const uint64_t*>(where), static_cast<T*>(dx), s);
  });
  LADDER_CUDA(cudaGetLastError());
}

}  // namespace rung
