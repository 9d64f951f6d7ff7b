#include "training_kernels.h"

#include <algorithm>

#include "device_helpers.cuh"

namespace rung {
namespace {

// Chan et al.'s pairwise update of (count, mean, M2) with (nb, mb, m2b).
template <typename F>
__host__ __device__ void combine(F& n, F& mean, F& m2, F nb, F mb, F m2b) {
  if (nb == 0) return;
  const F total = n + nb, delta = mb - mean;
  mean += delta * nb / total;
  m2 += m2b + delta * delta * n * nb / total;
  n = total;
}

// BatchNorm's reductions, vectorised as the elementwise passes: a thread holds 8 neighbouring channels (one 16-byte
// load per row in 16 bits), the C / 8 threads of a row are neighbours, and a block of kThreads covers kThreads / (C /
// 8) rows at a time; blockIdx.x picks one of gridDim.x interleaved sets of rows. Every ResNet-50 channel count divides
// 8 * kThreads into whole rows. Each thread loads kRowsInFlight rows before it folds any in, and the grid fills the
// chip (BnGrid): with one row in flight and too few blocks, the small layers ran at 14-28% of HBM bandwidth (Nsight
// Compute, H100). Every BatchNorm pass is bounded to 64 registers, 4 blocks of kThreads per SM.
constexpr int kRowsInFlight = 2;
constexpr int kGradRowsInFlight = 1;  // the backward's passes read three tensors: two rows spilled at 64 registers
constexpr int kBlocksPerSm = 4;

struct RowTiling {
  int lanes, rows;  // threads per row, rows per block step
  __device__ explicit RowTiling(int channels) : lanes(channels / kVec), rows(blockDim.x / (channels / kVec)) {}
};

template <typename T>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
bn_stats_kernel(const T* __restrict__ x, int64_t rows, int channels, float* __restrict__ partial) {
  const RowTiling tile(channels);
  const int lane = threadIdx.x % tile.lanes, sub = threadIdx.x / tile.lanes;
  const int64_t step = int64_t(gridDim.x) * tile.rows;
  float n = 0, mean[kVec] = {}, m2[kVec] = {};
  for (int64_t r0 = int64_t(blockIdx.x) * tile.rows + sub; r0 < rows; r0 += kRowsInFlight * step) {
    Pack<T> v[kRowsInFlight];
#pragma unroll
    for (int u = 0; u < kRowsInFlight; ++u)
      if (r0 + u * step < rows) v[u] = load_pack(x, size_t(r0 + u * step) * tile.lanes + lane);
#pragma unroll
    for (int u = 0; u < kRowsInFlight; ++u) {
      if (r0 + u * step >= rows) break;
      n += 1;
      const float inv = 1.f / n;  // Welford, one division per row for the thread's 8 channels
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float d = to_float(v[u].v[j]) - mean[j];
        mean[j] += d * inv;
        m2[j] += d * (to_float(v[u].v[j]) - mean[j]);
      }
    }
  }
  // The block's rows of each channel combined (Chan), in shared memory: [thread][channel of the thread].
  __shared__ float sn[kThreads], smean[kThreads][kVec], sm2[kThreads][kVec];
  sn[threadIdx.x] = n;
#pragma unroll
  for (int j = 0; j < kVec; ++j) smean[threadIdx.x][j] = mean[j], sm2[threadIdx.x][j] = m2[j];
  __syncthreads();
  if (sub != 0) return;
  for (int j = 0; j < kVec; ++j) {
    float cn = sn[lane], cmean = smean[lane][j], cm2 = sm2[lane][j];
    for (int i = 1; i < tile.rows; ++i) {
      const int t = i * tile.lanes + lane;
      combine(cn, cmean, cm2, sn[t], smean[t][j], sm2[t][j]);
    }
    float* out = partial + (size_t(blockIdx.x) * channels + lane * kVec + j) * 3;
    out[0] = cn;
    out[1] = cmean;
    out[2] = cm2;
  }
}

// One channel's batch statistics, (count, mean, M2) in fp64, to what the forward and backward use: the saved mean
// and 1/std (normalised with the biased variance), the running statistics updated as PyTorch does (with the unbiased
// variance, `momentum`), and the apply's scale and shift.
__device__ void finalize_channel(int c, int channels, double n, double mean, double m2, const float* gamma,
                                 const float* beta, float* running_mean, float* running_var, float momentum,
                                 float eps, float* save_mean, float* save_invstd, float* scale_shift) {
  const double invstd = 1.0 / sqrt(m2 / n + eps);
  save_mean[c] = float(mean);
  save_invstd[c] = float(invstd);
  running_mean[c] = float((1 - momentum) * running_mean[c] + momentum * mean);
  running_var[c] = float((1 - momentum) * running_var[c] + momentum * m2 / (n - 1));
  const double scale = gamma[c] * invstd;
  scale_shift[c] = float(scale);
  scale_shift[channels + c] = float(beta[c] - mean * scale);
}

__global__ void bn_finalize_kernel(const float* __restrict__ partial, int groups, int channels, const float* gamma,
                                   const float* beta, float* running_mean, float* running_var, float momentum,
                                   float eps, float* save_mean, float* save_invstd, float* scale_shift) {
  // One warp per channel: each lane combines a share of the groups, then the lanes combine pairwise.
  const int c = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
  if (c >= channels) return;
  double n = 0, mean = 0, m2 = 0;
  for (int g = lane; g < groups; g += 32) {
    const float* p = partial + (size_t(g) * channels + c) * 3;
    combine<double>(n, mean, m2, p[0], p[1], p[2]);
  }
  for (int o = 16; o > 0; o >>= 1)
    combine(n, mean, m2, __shfl_xor_sync(0xffffffffu, n, o), __shfl_xor_sync(0xffffffffu, mean, o),
            __shfl_xor_sync(0xffffffffu, m2, o));
  if (lane != 0) return;
  finalize_channel(c, channels, n, mean, m2, gamma, beta, running_mean, running_var, momentum, eps, save_mean,
                   save_invstd, scale_shift);
}

// From cuDNN's genstats (the convolution's epilogue): each channel's sum and sum of squares, fp32.
__global__ void bn_finalize_sums_kernel(const float* __restrict__ sums, int64_t rows, int channels,
                                        const float* gamma, const float* beta, float* running_mean, float* running_var,
                                        float momentum, float eps, float* save_mean, float* save_invstd,
                                        float* scale_shift) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= channels) return;
  const double n = double(rows), mean = sums[c] / n;
  const double m2 = fmax(double(sums[channels + c]) - mean * sums[c], 0.0);  // sum((x - mean)^2)
  finalize_channel(c, channels, n, mean, m2, gamma, beta, running_mean, running_var, momentum, eps, save_mean,
                   save_invstd, scale_shift);
}

// BatchNorm's affine map, one fused multiply-add. The forward's y = relu(affine(x) [+ z]) and the backward's ReLU
// mask recomputed from x (where no residual was added) both use it, so that affine(x) > 0 in the backward exactly
// where y > 0 in the forward. (In 16 bits, y also rounds to 0 where 0 < affine(x) < 2^-133: no real activation.)
__device__ __forceinline__ float bn_affine(float x, float scale, float shift) { return __fmaf_rn(x, scale, shift); }

// The elementwise passes: a grid-stride loop in which a thread's 8 channels never change (8 * kThreads and the
// stride are multiples of every channel count), so each thread reads its per-channel coefficients once, into
// registers. Reading them from memory for every pack made these passes L1-bound (Nsight Compute, H100: the small
// layers' apply at 33% of HBM bandwidth). kRowsInFlight packs are loaded before any is written.
struct ChannelStride {
  size_t first, stride;
  int c0;  // the thread's first channel
  __device__ explicit ChannelStride(int channels)
      : first(blockIdx.x * size_t(blockDim.x) + threadIdx.x),
        stride(size_t(gridDim.x) * blockDim.x),
        c0(int(threadIdx.x * kVec % channels)) {}
};

template <typename T>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
bn_apply_kernel(const T* __restrict__ x, const T* __restrict__ z, T* __restrict__ y, bool relu,
                                size_t packs, int channels, const float* __restrict__ scale_shift) {
  const ChannelStride at(channels);
  float scale[kVec], shift[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) scale[j] = scale_shift[at.c0 + j], shift[j] = scale_shift[channels + at.c0 + j];
  for (size_t i0 = at.first; i0 < packs; i0 += kRowsInFlight * at.stride) {
    Pack<T> in[kRowsInFlight], add[kRowsInFlight];
#pragma unroll
    for (int u = 0; u < kRowsInFlight; ++u) {
      const size_t i = i0 + u * at.stride;
      if (i < packs) {
        in[u] = load_pack(x, i);
        if (z) add[u] = load_pack(z, i);
      }
    }
#pragma unroll
    for (int u = 0; u < kRowsInFlight; ++u) {
      const size_t i = i0 + u * at.stride;
      if (i >= packs) break;
      Pack<T> out;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        float v = bn_affine(to_float(in[u].v[j]), scale[j], shift[j]);
        if (z) v += to_float(add[u].v[j]);
        out.v[j] = from_float<T>(relu ? fmaxf(v, 0.f) : v);
      }
      store_pack(y, i, out);
    }
  }
}

// ReLU's mask in the backward: from the forward's output y where it is given (a residual was added before the ReLU),
// else from affine(x) where the forward's scale and shift are given (`affine`: no y to read), else none.
template <typename T>
struct ReluMask {
  const T* y;
  const float* affine;
  float scale[kVec], shift[kVec];
  __device__ ReluMask(const T* y_, const float* affine_, int channels, int c0) : y(y_), affine(affine_) {
    if (!affine) return;
#pragma unroll
    for (int j = 0; j < kVec; ++j) scale[j] = affine[c0 + j], shift[j] = affine[channels + c0 + j];
  }
  // dy where the forward's ReLU passed it, else 0 (PyTorch's threshold_backward); `out` holds y's pack if y is given.
  __device__ float operator()(float dy, const Pack<T>& out, const Pack<T>& in, int j) const {
    if (y) return to_float(out.v[j]) <= 0.f ? 0.f : dy;
    if (affine) return bn_affine(to_float(in.v[j]), scale[j], shift[j]) <= 0.f ? 0.f : dy;
    return dy;
  }
};

template <typename T, int InFlight>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
bn_grad_sums_kernel(const T* __restrict__ dy, const T* __restrict__ y, const T* __restrict__ x,
                    const float* __restrict__ affine, int64_t rows, int channels, const float* __restrict__ save_mean,
                    float* __restrict__ partial) {
  const RowTiling tile(channels);
  const int lane = threadIdx.x % tile.lanes, sub = threadIdx.x / tile.lanes;
  const int64_t step = int64_t(gridDim.x) * tile.rows;
  const ReluMask<T> mask(y, affine, channels, lane * kVec);
  float mean[kVec], sum[kVec] = {}, dot[kVec] = {};  // dot: sum(dy' * (x - mean)); 1/std applied in the finalize
#pragma unroll
  for (int j = 0; j < kVec; ++j) mean[j] = save_mean[lane * kVec + j];
  for (int64_t r0 = int64_t(blockIdx.x) * tile.rows + sub; r0 < rows; r0 += InFlight * step) {
    Pack<T> g[InFlight], in[InFlight], out[InFlight];
#pragma unroll
    for (int u = 0; u < InFlight; ++u) {
      if (r0 + u * step >= rows) continue;
      const size_t at = size_t(r0 + u * step) * tile.lanes + lane;
      g[u] = load_pack(dy, at);
      in[u] = load_pack(x, at);
      if (y) out[u] = load_pack(y, at);
    }
#pragma unroll
    for (int u = 0; u < InFlight; ++u) {
      if (r0 + u * step >= rows) break;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float d = mask(to_float(g[u].v[j]), out[u], in[u], j);
        sum[j] += d;
        dot[j] += d * (to_float(in[u].v[j]) - mean[j]);
      }
    }
  }
  __shared__ float ssum[kThreads][kVec], sdot[kThreads][kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) ssum[threadIdx.x][j] = sum[j], sdot[threadIdx.x][j] = dot[j];
  __syncthreads();
  if (sub != 0) return;
  for (int j = 0; j < kVec; ++j) {
    float s = 0, d = 0;
    for (int i = 0; i < tile.rows; ++i) s += ssum[i * tile.lanes + lane][j], d += sdot[i * tile.lanes + lane][j];
    float* out = partial + (size_t(blockIdx.x) * channels + lane * kVec + j) * 3;
    out[0] = s;
    out[1] = d;
  }
}

// dx = gamma * invstd * (dy' - mean(dy') - xhat * mean(dy' * xhat)), folded per channel into dx = a * dy' + b * x + c,
// with a = gamma * invstd, b = -a * invstd * mean(dy' * xhat), c = -a * mean(dy') - b * mean, in fp64: coef holds
// a, b and c, kBnCoefs x channels.
__global__ void bn_grad_finalize_kernel(const float* __restrict__ partial, int groups, int channels, int64_t rows,
                                        const float* gamma, const float* save_mean, const float* save_invstd,
                                        float* dgamma, float* dbeta, float* coef) {
  const int c = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;  // a warp per channel
  if (c >= channels) return;
  double sum = 0, dot = 0;
  for (int g = lane; g < groups; g += 32) {
    sum += partial[(size_t(g) * channels + c) * 3];
    dot += partial[(size_t(g) * channels + c) * 3 + 1];
  }
  for (int o = 16; o > 0; o >>= 1) {
    sum += __shfl_xor_sync(0xffffffffu, sum, o);
    dot += __shfl_xor_sync(0xffffffffu, dot, o);
  }
  if (lane != 0) return;
  dot *= save_invstd[c];  // sum(dy' * xhat)
  dbeta[c] = float(sum);
  dgamma[c] = float(dot);
  const double a = double(gamma[c]) * save_invstd[c], b = -a * save_invstd[c] * (dot / rows);
  coef[c] = float(a);
  coef[channels + c] = float(b);
  coef[2 * channels + c] = float(-a * (sum / rows) - b * save_mean[c]);
}

template <typename T, int InFlight>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
bn_grad_apply_kernel(const T* dy, const T* __restrict__ y, const T* __restrict__ x, T* dx, T* dz,
                     const float* __restrict__ affine, size_t packs, int channels, const float* __restrict__ coef) {
  const ChannelStride at(channels);
  const ReluMask<T> mask(y, affine, channels, at.c0);
  float a[kVec], b[kVec], c[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j)
    a[j] = coef[at.c0 + j], b[j] = coef[channels + at.c0 + j], c[j] = coef[2 * channels + at.c0 + j];
  for (size_t i0 = at.first; i0 < packs; i0 += InFlight * at.stride) {
    Pack<T> g[InFlight], in[InFlight], out[InFlight];
#pragma unroll
    for (int u = 0; u < InFlight; ++u) {
      const size_t i = i0 + u * at.stride;
      if (i >= packs) continue;
      g[u] = load_pack(dy, i);
      in[u] = load_pack(x, i);
      if (y) out[u] = load_pack(y, i);
    }
#pragma unroll
    for (int u = 0; u < InFlight; ++u) {
      const size_t i = i0 + u * at.stride;
      if (i >= packs) break;
      Pack<T> masked, grad;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float d = mask(to_float(g[u].v[j]), out[u], in[u], j);
        masked.v[j] = from_float<T>(d);
        grad.v[j] = from_float<T>(a[j] * d + b[j] * to_float(in[u].v[j]) + c[j]);
      }
      store_pack(dx, i, grad);  // dx may be dy: each pack is read, then written, by the same thread
      if (dz) store_pack(dz, i, masked);
    }
  }
}

// Sum of a block's values, for every thread (blockDim.x a multiple of 32, at most 1024).
__device__ float block_sum(float v, float* shared) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
  __syncthreads();
  if (threadIdx.x % 32 == 0) shared[warp] = v;
  __syncthreads();
  float total = 0;
  for (int w = 0; w < warps; ++w) total += shared[w];
  return total;
}

__device__ float block_max(float v, float* shared) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
  __syncthreads();
  if (threadIdx.x % 32 == 0) shared[warp] = v;
  __syncthreads();
  float best = -INFINITY;
  for (int w = 0; w < warps; ++w) best = fmaxf(best, shared[w]);
  return best;
}

template <typename T>
__global__ void cross_entropy_kernel(const T* __restrict__ logits, const int* __restrict__ labels,
                                     T* __restrict__ dlogits, int batch, int classes, float* __restrict__ row_loss) {
  __shared__ float shared[32];
  const int row = blockIdx.x;
  const T* in = logits + size_t(row) * classes;
  float best = -INFINITY;
  for (int j = threadIdx.x; j < classes; j += blockDim.x) best = fmaxf(best, to_float(in[j]));
  best = block_max(best, shared);
  float sum = 0;
  for (int j = threadIdx.x; j < classes; j += blockDim.x) sum += expf(to_float(in[j]) - best);
  sum = block_sum(sum, shared);
  const int label = labels[row];
  for (int j = threadIdx.x; j < classes; j += blockDim.x) {
    const float p = expf(to_float(in[j]) - best) / sum;
    dlogits[size_t(row) * classes + j] = from_float<T>((p - (j == label ? 1.f : 0.f)) / batch);
  }
  if (threadIdx.x == 0) row_loss[row] = logf(sum) + best - to_float(in[label]);
}

__global__ void loss_mean_kernel(const float* __restrict__ row_loss, int batch, float* last_loss, float* history,
                                 int* count, int capacity) {
  __shared__ float shared[32];
  float sum = 0;
  for (int i = threadIdx.x; i < batch; i += blockDim.x) sum += row_loss[i];
  sum = block_sum(sum, shared);
  if (threadIdx.x != 0) return;
  *last_loss = sum / batch;
  if (*count < capacity) history[*count] = sum / batch;
  *count += 1;
}

template <typename T>
__global__ void column_sum_kernel(const T* __restrict__ dy, T* __restrict__ db, int batch, int classes) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= classes) return;
  float sum = 0;
  for (int i = 0; i < batch; ++i) sum += to_float(dy[size_t(i) * classes + j]);
  db[j] = from_float<T>(sum);
}

template <typename T>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
add_kernel(const T* a, const T* __restrict__ b, T* out, size_t packs) {  // out may be a
  const size_t first = blockIdx.x * size_t(blockDim.x) + threadIdx.x, stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i0 = first; i0 < packs; i0 += kRowsInFlight * stride) {
    Pack<T> x[kRowsInFlight], y[kRowsInFlight];
#pragma unroll
    for (int u = 0; u < kRowsInFlight; ++u)
      if (i0 + u * stride < packs) x[u] = load_pack(a, i0 + u * stride), y[u] = load_pack(b, i0 + u * stride);
#pragma unroll
    for (int u = 0; u < kRowsInFlight; ++u) {
      if (i0 + u * stride >= packs) break;
      Pack<T> o;
#pragma unroll
      for (int j = 0; j < kVec; ++j) o.v[j] = from_float<T>(to_float(x[u].v[j]) + to_float(y[u].v[j]));
      store_pack(out, i0 + u * stride, o);
    }
  }
}

__device__ float load_as_float(const void* p, Storage t, int64_t i) {
  switch (t) {
    case Storage::F16: return __half2float(static_cast<const __half*>(p)[i]);
    case Storage::BF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

__device__ void store_from_float(void* p, Storage t, int64_t i, float v) {
  switch (t) {
    case Storage::F16: static_cast<__half*>(p)[i] = __float2half_rn(v); break;
    case Storage::BF16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v); break;
    default: static_cast<float*>(p)[i] = v;
  }
}

struct Chunk {
  int tensor;
  int64_t begin, end;
};
constexpr int64_t kChunk = 8192;  // elements per block

__global__ void sgd_kernel(const SgdTensor* __restrict__ tensors, const Chunk* __restrict__ chunks, float lr,
                           float momentum, float weight_decay) {
  const Chunk ch = chunks[blockIdx.x];
  const SgdTensor t = tensors[ch.tensor];
  for (int64_t i = ch.begin + threadIdx.x; i < ch.end; i += blockDim.x) {
    float w = t.master[i];
    const float g = load_as_float(t.grad, t.grad_type, i) + weight_decay * w;
    const float buf = momentum * t.momentum[i] + g;  // zero-initialised: the first step's buf is g, as PyTorch's
    t.momentum[i] = buf;
    w -= lr * buf;
    t.master[i] = w;
    if (t.copy) store_from_float(t.copy, t.copy_type, i, w);
  }
}

int sm_count() {
  static const int count = [] {
    int device = 0, n = 0;
    LADDER_CUDA(cudaGetDevice(&device));
    LADDER_CUDA(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
    return n;
  }();
  return count;
}

// Blocks for an elementwise pass: one resident wave (each thread loops over many packs, so its per-channel
// coefficients are read once), fewer where the tensor is small.
unsigned packs_blocks(size_t packs, int in_flight = kRowsInFlight) {
  return unsigned(std::min<size_t>(blocks_for((packs + in_flight - 1) / in_flight),
                                   size_t(sm_count()) * kBlocksPerSm));
}

}  // namespace

BnGrid BnGrid::for_shape(int64_t rows, int channels) {
  // One resident wave (kBlocksPerSm per SM), and at least 8 rows per thread. With at least 32, the small layers had
  // too few blocks to fill the chip (98-196 for 132 SMs: 11-14% occupancy, Nsight Compute).
  const int64_t rows_per_step = kThreads / (channels / kVec);
  const int64_t wave = int64_t(sm_count()) * kBlocksPerSm;
  return {int(std::max<int64_t>(1, std::min<int64_t>(rows / (rows_per_step * 8), wave)))};
}

static void check_bn_channels(int channels) {
  if (channels % kVec || kThreads % (channels / kVec))
    throw std::runtime_error("BatchNorm kernels need 8 x a divisor of " + std::to_string(kThreads) + " channels");
}

void bn_statistics(const void* x, Storage st, int64_t rows, int channels, float* partial, cudaStream_t stream) {
  check_bn_channels(channels);
  with_type(st, [&](auto t) {
    using T = decltype(t);
    bn_stats_kernel<T><<<BnGrid::for_shape(rows, channels).groups, kThreads, 0, stream>>>(
        static_cast<const T*>(x), rows, channels, partial);
  });
  LADDER_CUDA(cudaGetLastError());
}

void bn_forward(const void* x, const void* z, void* y, bool relu, Storage st, int64_t rows, int channels,
                const float* stats, bool sums, const float* gamma, const float* beta, float* running_mean,
                float* running_var, float momentum, float eps, float* save_mean, float* save_invstd,
                float* scale_shift, cudaStream_t stream) {
  check_bn_channels(channels);
  const size_t packs = size_t(rows) * channels / kVec;
  if (sums)
    bn_finalize_sums_kernel<<<blocks_for(channels), kThreads, 0, stream>>>(
        stats, rows, channels, gamma, beta, running_mean, running_var, momentum, eps, save_mean, save_invstd,
        scale_shift);
  else
    bn_finalize_kernel<<<(channels + 7) / 8, kThreads, 0, stream>>>(
        stats, BnGrid::for_shape(rows, channels).groups, channels, gamma, beta, running_mean, running_var, momentum,
        eps, save_mean, save_invstd, scale_shift);
  with_type(st, [&](auto t) {
    using T = decltype(t);
    bn_apply_kernel<T><<<packs_blocks(packs), kThreads, 0, stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(z), static_cast<T*>(y), relu, packs, channels, scale_shift);
  });
  LADDER_CUDA(cudaGetLastError());
}

void bn_backward(const void* dy, const void* y, const float* affine, const void* x, void* dx, void* dz, Storage st,
                 int64_t rows, int channels, const float* gamma, const float* save_mean, const float* save_invstd,
                 float* dgamma, float* dbeta, float* coef, float* scratch, BnGrid grid, cudaStream_t stream) {
  const size_t packs = size_t(rows) * channels / kVec;
  with_type(st, [&](auto t) {
    using T = decltype(t);
    bn_grad_sums_kernel<T, kGradRowsInFlight><<<grid.groups, kThreads, 0, stream>>>(
        static_cast<const T*>(dy), static_cast<const T*>(y), static_cast<const T*>(x), affine, rows, channels,
        save_mean, scratch);
    bn_grad_finalize_kernel<<<(channels + 7) / 8, kThreads, 0, stream>>>(scratch, grid.groups, channels, rows, gamma,
                                                                        save_mean, save_invstd, dgamma, dbeta, coef);
    bn_grad_apply_kernel<T, kGradRowsInFlight><<<packs_blocks(packs, kGradRowsInFlight), kThreads, 0, stream>>>(
        static_cast<const T*>(dy), static_cast<const T*>(y), static_cast<const T*>(x), static_cast<T*>(dx),
        static_cast<T*>(dz), affine, packs, channels, coef);
  });
  LADDER_CUDA(cudaGetLastError());
}

void cross_entropy(const void* logits, const int* labels, void* dlogits, Storage st, int batch, int classes,
                   float* row_loss, float* last_loss, float* history, int* count, int capacity, cudaStream_t stream) {
  with_type(st, [&](auto t) {
    using T = decltype(t);
    cross_entropy_kernel<T><<<batch, kThreads, 0, stream>>>(static_cast<const T*>(logits), labels,
                                                            static_cast<T*>(dlogits), batch, classes, row_loss);
  });
  loss_mean_kernel<<<1, kThreads, 0, stream>>>(row_loss, batch, last_loss, history, count, capacity);
  LADDER_CUDA(cudaGetLastError());
}

void column_sum(const void* dy, void* db, Storage st, int batch, int classes, cudaStream_t stream) {
  with_type(st, [&](auto t) {
    using T = decltype(t);
    column_sum_kernel<T><<<blocks_for(classes), kThreads, 0, stream>>>(static_cast<const T*>(dy), static_cast<T*>(db),
                                                                      batch, classes);
  });
  LADDER_CUDA(cudaGetLastError());
}

void add(const void* a, const void* b, void* out, Storage st, size_t n, cudaStream_t stream) {
  if (n % kVec) throw std::runtime_error("add needs a multiple of 8 elements");
  with_type(st, [&](auto t) {
    using T = decltype(t);
    add_kernel<T><<<packs_blocks(n / kVec), kThreads, 0, stream>>>(static_cast<const T*>(a), static_cast<const T*>(b),
                                                                   static_cast<T*>(out), n / kVec);
  });
  LADDER_CUDA(cudaGetLastError());
}

Sgd::Sgd(const std::vector<SgdTensor>& tensors) {
  std::vector<Chunk> chunks;
  for (size_t t = 0; t < tensors.size(); ++t)
    for (int64_t b = 0; b < tensors[t].n; b += kChunk)
      chunks.push_back({int(t), b, std::min(b + kChunk, tensors[t].n)});
  tensors_ = DeviceBuffer(tensors.size() * sizeof(SgdTensor));
  chunks_ = DeviceBuffer(chunks.size() * sizeof(Chunk));
  LADDER_CUDA(cudaMemcpy(tensors_.get(), tensors.data(), tensors_.bytes(), cudaMemcpyHostToDevice));
  LADDER_CUDA(cudaMemcpy(chunks_.get(), chunks.data(), chunks_.bytes(), cudaMemcpyHostToDevice));
  n_chunks_ = int(chunks.size());
}

void Sgd::step(float lr, float momentum, float weight_decay, cudaStream_t stream) const {
  sgd_kernel<<<n_chunks_, kThreads, 0, stream>>>(static_cast<const SgdTensor*>(tensors_.get()),
                                                 static_cast<const Chunk*>(chunks_.get()), lr, momentum, weight_decay);
  LADDER_CUDA(cudaGetLastError());
}

}  // namespace rung
