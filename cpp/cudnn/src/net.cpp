#include "net.h"

#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>

#include "checks.h"
#include "gpu_timing.h"
#include "inference_kernels.h"
#include "memory_plan.h"
#include "pool_kernels.h"

namespace rung {

struct ResNet50::Pool : PoolDesc {
  using PoolDesc::PoolDesc;
  int in = -1, out = -1;
  // Max-pooling in NHWC runs on our kernel (pool_kernels.h, shared with the training step): cuDNN's took 0.31 ms for
  // the stem's at bf16 batch 256 on the H100, twice its bytes' time.
  bool ours = false;
  PoolShape shape{};
};

PoolDesc::PoolDesc(bool max, int window, int stride, int pad, const Precision& p, bool nhwc, int n, int c, int h,
                   int w)
    : out_h((h + 2 * pad - window) / stride + 1), out_w((w + 2 * pad - window) / stride + 1) {
  const cudnnTensorFormat_t format = nhwc ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW;
  CUDNN_CHECK(cudnnCreatePoolingDescriptor(&desc));
  // Max pooling ignores the padding (PyTorch pads with -inf); the average pool has no padding.
  CUDNN_CHECK(cudnnSetPooling2dDescriptor(desc, max ? CUDNN_POOLING_MAX : CUDNN_POOLING_AVERAGE_COUNT_EXCLUDE_PADDING,
                                          CUDNN_NOT_PROPAGATE_NAN, window, window, pad, pad, stride, stride));
  CUDNN_CHECK(cudnnCreateTensorDescriptor(&x));
  CUDNN_CHECK(cudnnSetTensor4dDescriptor(x, format, p.cudnn, n, c, h, w));
  CUDNN_CHECK(cudnnCreateTensorDescriptor(&y));
  CUDNN_CHECK(cudnnSetTensor4dDescriptor(y, format, p.cudnn, n, c, out_h, out_w));
}

PoolDesc::~PoolDesc() {
  if (y) cudnnDestroyTensorDescriptor(y);
  if (x) cudnnDestroyTensorDescriptor(x);
  if (desc) cudnnDestroyPoolingDescriptor(desc);
}

const ladder::HostTensor& weight(const ladder::TensorMap& w, const std::string& name,
                                 const std::vector<int64_t>& shape) {
  auto it = w.find(name);
  if (it == w.end()) throw std::runtime_error("weights file has no " + name + " (not torchvision's resnet50?)");
  if (it->second.shape != shape)
    throw std::runtime_error(name + " has shape " + shape_str(it->second.shape) + ", resnet50 has " +
                             shape_str(shape));
  return it->second;
}

namespace {

// All weights staged on the host in the storage type, each tensor 256-byte aligned, uploaded in one copy.
class WeightArena {
 public:
  explicit WeightArena(Storage s) : storage_(s) {}
  size_t add(const std::vector<float>& values) {
    std::vector<uint8_t> bytes = encode(values, storage_);
    size_t offset = data_.size();
    data_.resize(align_up(offset + bytes.size()));
    std::memcpy(data_.data() + offset, bytes.data(), bytes.size());
    return offset;
  }
  const std::vector<uint8_t>& data() const { return data_; }

 private:
  Storage storage_;
  std::vector<uint8_t> data_;
};

// Eval-mode batch-norm folded into the convolution before it: w' = w * g / sqrt(v + eps), b' = beta - mean * that,
// computed in double. Filters come out KRSC (NHWC) or KCRS (NCHW) with input channels c_true..c zero (padding).
void fold(const ladder::TensorMap& W, const std::string& conv, const std::string& bn, const ConvShape& s, int c_true,
          bool nhwc, std::vector<float>& w_out, std::vector<float>& b_out) {
  const int k = s.k, r = s.r, c = s.c;
  const auto& w = weight(W, conv + ".weight", {k, c_true, r, r}).data;
  const auto& gamma = weight(W, bn + ".weight", {k}).data;
  const auto& beta = weight(W, bn + ".bias", {k}).data;
  const auto& mean = weight(W, bn + ".running_mean", {k}).data;
  const auto& var = weight(W, bn + ".running_var", {k}).data;
  w_out.assign(size_t(k) * c * r * r, 0.f);
  b_out.resize(k);
  for (int o = 0; o < k; ++o) {
    double scale = gamma[o] / std::sqrt(double(var[o]) + kBnEps);
    b_out[o] = float(beta[o] - mean[o] * scale);
    for (int i = 0; i < c_true; ++i)
      for (int y = 0; y < r; ++y)
        for (int x = 0; x < r; ++x) {
          size_t dst = nhwc ? ((size_t(o) * r + y) * r + x) * c + i : ((size_t(o) * c + i) * r + y) * r + x;
          w_out[dst] = float(w[((size_t(o) * c_true + i) * r + y) * r + x] * scale);
        }
  }
}

}  // namespace

ResNet50::ResNet50(const NetOptions& o, const ladder::TensorMap& weights, const ladder::HostTensor& input,
                   cudaStream_t stream, ladder::Json& stats)
    : o_(o), stream_(stream) {
  const Precision& p = o_.precision;
  if (!o_.nhwc && p.storage != Storage::F32) throw std::runtime_error("16-bit storage runs NHWC only");
  if (input.shape != std::vector<int64_t>{o_.batch, 3, o_.res, o_.res})
    throw std::runtime_error("input has shape " + shape_str(input.shape) + ", expected [batch, 3, res, res]");
  CUDNN_CHECK(cudnnCreate(&handle_));
  CUDNN_CHECK(cudnnSetStream(handle_, stream_));

  // The network, as shapes. The stem is a 7x7 stride-2 convolution over 3 channels, then a 3x3 stride-2 max-pool.
  // On tensor cores (where its output size is even) the convolution runs between tiled layouts (stem.h): the input
  // in 4x4 pixel tiles, made once at build as every rung's input is converted, the output in 2x2 pixel tiles, which
  // our max-pool reads. Elsewhere NHWC, its channels zero-padded to 16 bytes for tensor cores, or NCHW.
  const bool tiled = o_.nhwc && p.tensor_cores() && stem_output(o_.res) % 2 == 0;
  const InputLayout layout =
      tiled ? tiled_stem_input(o_.res)
            : InputLayout{0, 1, o_.res, o_.res, o_.nhwc && p.tensor_cores() ? int(16 / p.bytes) : 3};
  acts_.push_back({layout.c_pad, layout.out_h, layout.out_w});
  int x = tiled ? add_conv("conv1", "bn1", 0, 4 * 64, kStemTaps, 1, 0, Epilogue::BiasRelu, -1, 2)
                : add_conv("conv1", "bn1", 0, 64, 7, 2, 3, Epilogue::BiasRelu);
  x = add_pool(x, true, 3, 2, 1);
  const int widths[] = {64, 128, 256, 512}, blocks[] = {3, 4, 6, 3};
  for (int l = 0; l < 4; ++l)
    for (int b = 0; b < blocks[l]; ++b) {
      // torchvision's Bottleneck (v1.5: the stride sits on the 3x3); the first block of a stage projects the skip.
      const std::string name = "layer" + std::to_string(l + 1) + "." + std::to_string(b) + ".";
      const int stride = b == 0 && l > 0 ? 2 : 1, width = widths[l];
      int skip = b == 0 ? add_conv(name + "downsample.0", name + "downsample.1", x, width * 4, 1, stride, 0,
                                   Epilogue::Bias)
                        : x;
      int t = add_conv(name + "conv1", name + "bn1", x, width, 1, 1, 0, Epilogue::BiasRelu);
      t = add_conv(name + "conv2", name + "bn2", t, width, 3, stride, 1, Epilogue::BiasRelu);
      x = add_conv(name + "conv3", name + "bn3", t, width * 4, 1, 1, 0, Epilogue::BiasAddRelu, skip);
    }
  const Act last = acts_[x];
  x = add_pool(x, false, last.h, last.h, 0);  // global average pool: one window over the whole map
  steps_.push_back({Step::Fc, 0, {x}, -1});

  // Weights: folded, laid out, converted and uploaded once.
  WeightArena arena(p.storage);
  std::vector<std::pair<size_t, size_t>> offsets;  // (filter, bias) per convolution
  for (const ConvDef& d : defs_) {
    std::vector<float> w, b;
    if (d.in == 0 && tiled) {
      const ConvShape stem{o_.batch, 3, o_.res, o_.res, 64, 7, 7, 2, 3};
      fold(weights, d.name, d.bn, stem, 3, true, w, b);
      w = tiled_stem_filter(w, stem.k, stem.c, d.spec.shape.c);
      b = tiled_stem_bias(b);
    } else {
      fold(weights, d.name, d.bn, d.spec.shape, d.in == 0 ? 3 : d.spec.shape.c, o_.nhwc, w, b);
    }
    offsets.emplace_back(arena.add(w), arena.add(b));
  }
  const int features = acts_[x].c, classes = 1000;
  size_t fc_w = arena.add(weight(weights, "fc.weight", {classes, features}).data);
  size_t fc_b = arena.add(weight(weights, "fc.bias", {classes}).data);
  weights_ = DeviceBuffer(arena.data().size());
  upload(weights_.get(), arena.data().data(), arena.data().size(), stream_);
  auto wptr = [&](size_t off) { return static_cast<const char*>(weights_.get()) + off; };

  // Input: the contract's fp32 NCHW converted once into this rung's dtype and layout.
  input_ = DeviceBuffer(size_t(o_.batch) * layout.c_pad * layout.out_h * layout.out_w * p.bytes);
  acts_[0].ptr = input_.get();
  if (o_.nhwc) {
    DeviceBuffer staging(input.data.size() * sizeof(float));
    upload(staging.get(), input.data.data(), staging.bytes(), stream_);
    nchw_to_nhwc(static_cast<const float*>(staging.get()), input_.get(), p.storage, o_.batch, 3, o_.res, o_.res,
                 layout, stream_);
    LADDER_CUDA(cudaStreamSynchronize(stream_));
  } else {
    upload(input_.get(), input.data.data(), input_.bytes(), stream_);
  }
  output_ = DeviceBuffer(size_t(o_.batch) * classes * p.bytes);
  plan_memory(stats);

  // Tune each distinct (shape, epilogue) once; layers that repeat it share the plan.
  double t0 = ladder::now_s();
  size_t workspace = 0;
  {
    ConvPlanner planner(handle_, o_.engine(), stream_);
    for (size_t i = 0; i < defs_.size(); ++i) {
      const ConvDef& d = defs_[i];
      ConvIO io{acts_[d.in].ptr, wptr(offsets[i].first), wptr(offsets[i].second),
                d.residual >= 0 ? acts_[d.residual].ptr : nullptr, acts_[d.out].ptr};
      convs_.emplace_back(d.name, d.spec, io, planner.plan(d.spec, io));
    }
    fc_ = std::make_unique<Linear>(p, o_.batch, features, classes, wptr(fc_w), wptr(fc_b), acts_[x].ptr,
                                   output_.get(), planner.scratch(), stream_);
    workspace = std::max(planner.workspace(), fc_->workspace());
    planner.report(stats);
  }
  stats["autotune_s"] = ladder::now_s() - t0;

  // One workspace for all: the steps run one after another on one stream.
  if (workspace) workspace_ = DeviceBuffer(workspace);
  for (ConvLayer& c : convs_) c.bind(workspace_.get());
  fc_->bind(workspace_.get());

  ladder::Json convs = ladder::Json::array();
  int fused = 0, fused_residual = 0;
  for (const ConvLayer& c : convs_) {
    ladder::Json j = ladder::Json::object();
    j["name"] = c.name();
    j["shape"] = c.spec().shape.str();
    j["epilogue"] = epilogue_name(c.spec().epilogue);
    for (auto& kv : c.plan().stats().obj) j[kv.first] = kv.second;
    convs.push_back(j);
    fused += c.plan().fused;
    fused_residual += c.plan().fused && c.spec().epilogue == Epilogue::BiasAddRelu;
  }
  stats["layout"] = o_.nhwc ? "NHWC" : "NCHW";
  stats["input_layout"] = (tiled ? "NHWC in 4x4 pixel tiles " : o_.nhwc ? "NHWC " : "NCHW ") +
                          shape_str({layout.out_h, layout.out_w, layout.c_pad});
  stats["convs_total"] = int(convs_.size());
  stats["convs_fused"] = fused;
  stats["convs_fused_with_residual"] = fused_residual;
  stats["convs"] = convs;
  stats["fc"] = fc_->stats();
}

ResNet50::~ResNet50() {
  pools_.clear();
  if (handle_) cudnnDestroy(handle_);
}

int ResNet50::add_conv(const std::string& conv, const std::string& bn, int in, int k, int r, int stride, int pad,
                       Epilogue e, int residual, int out_tile) {
  const Act a = acts_[in];
  ConvShape s{o_.batch, a.c, a.h, a.w, k, r, r, stride, pad};
  acts_.push_back({k / (out_tile * out_tile), s.p() * out_tile, s.q() * out_tile, out_tile});
  const int out = int(acts_.size()) - 1;
  defs_.push_back({conv, bn, in, out, residual, ConvSpec{s, e, &o_.precision, o_.nhwc}});
  std::vector<int> reads = {in};
  if (residual >= 0) reads.push_back(residual);
  steps_.push_back({Step::Conv, int(defs_.size()) - 1, reads, out});
  return out;
}

int ResNet50::add_pool(int in, bool max, int window, int stride, int pad) {
  const Act a = acts_[in];
  auto pool = std::make_unique<Pool>(max, window, stride, pad, o_.precision, o_.nhwc, o_.batch, a.c, a.h, a.w);
  acts_.push_back({a.c, pool->out_h, pool->out_w});
  pool->in = in;
  pool->out = int(acts_.size()) - 1;
  pool->ours = max && o_.nhwc && a.c % 8 == 0;
  if (a.tile != 1 && !pool->ours) throw std::runtime_error("only our max-pool reads pixel tiles");
  pool->shape = {o_.batch, a.c, a.h, a.w, window, stride, pad, pool->out_h, pool->out_w};
  pools_.push_back(std::move(pool));
  steps_.push_back({Step::Pooling, int(pools_.size()) - 1, {in}, int(acts_.size()) - 1});
  return int(acts_.size()) - 1;
}

void ResNet50::plan_memory(ladder::Json& stats) {
  std::vector<size_t> bytes;
  for (const Act& a : acts_) bytes.push_back(align_up(size_t(o_.batch) * a.c * a.h * a.w * o_.precision.bytes));
  bytes[0] = 0;  // the input has its own buffer
  std::vector<PlannedStep> steps;
  for (const Step& s : steps_)
    steps.push_back({s.reads, s.writes >= 0 ? std::vector<int>{s.writes} : std::vector<int>{}});
  const MemoryPlan plan = rung::plan_memory(bytes, steps);
  activations_ = DeviceBuffer(plan.total);
  for (size_t a = 0; a < acts_.size(); ++a)
    if (plan.offsets[a] >= 0) acts_[a].ptr = static_cast<char*>(activations_.get()) + plan.offsets[a];
  ladder::Json j = ladder::Json::object();
  j["activation_bytes"] = static_cast<unsigned long long>(plan.total);
  j["peak_live_bytes"] = static_cast<unsigned long long>(plan.peak_live);
  stats["memory_plan"] = j;
}

void ResNet50::issue() const {
  for (size_t i = 0; i < steps_.size(); ++i) issue_step(i);
}

void ResNet50::issue_step(size_t i) const {
  const float one = 1.f, zero = 0.f;
  const Step& s = steps_[i];
  switch (s.kind) {
    case Step::Conv: convs_[s.index].run(handle_, stream_); break;
    case Step::Pooling: {
      const Pool& p = *pools_[s.index];
      if (p.ours)
        max_pool_forward(acts_[p.in].ptr, acts_[p.out].ptr, nullptr, o_.precision.storage, p.shape,
                         acts_[p.in].tile == 2, stream_);
      else
        CUDNN_CHECK(cudnnPoolingForward(handle_, p.desc, &one, p.x, acts_[p.in].ptr, &zero, p.y, acts_[p.out].ptr));
      break;
    }
    case Step::Fc: fc_->run(stream_); break;
  }
}

std::pair<std::string, std::string> ResNet50::step_layer(size_t i) const {
  const Step& s = steps_[i];
  switch (s.kind) {
    case Step::Conv: return {convs_[s.index].name(), "forward"};  // its batch-norm, add and ReLU fused in
    case Step::Pooling: return {s.index == 0 ? "maxpool" : "avgpool", "forward"};
    case Step::Fc: return {"fc", "forward"};
  }
  return {"", "forward"};
}

ladder::TensorMap ResNet50::result(int) const {
  std::vector<uint8_t> host(output_.bytes());
  LADDER_CUDA(cudaMemcpyAsync(host.data(), output_.get(), host.size(), cudaMemcpyDeviceToHost, stream_));
  LADDER_CUDA(cudaStreamSynchronize(stream_));
  return {{"output", {{o_.batch, 1000}, decode(host.data(), host.size() / o_.precision.bytes, o_.precision.storage)}}};
}

void ResNet50::report_memory(ladder::Json& memory) const {
  memory["workspace_bytes"] = static_cast<unsigned long long>(workspace_.bytes());
  memory["activation_bytes"] = static_cast<unsigned long long>(activations_.bytes());
  memory["weights_bytes"] = static_cast<unsigned long long>(weights_.bytes());
  memory["io_bytes"] = static_cast<unsigned long long>(input_.bytes() + output_.bytes());
}

ladder::Json ResNet50::micro(int reps) const {
  ladder::Json list = ladder::Json::array();
  std::map<std::string, size_t> seen;
  for (const ConvLayer& c : convs_) {
    const ConvShape& s = c.spec().shape;
    const std::string key = c.spec().key();
    if (seen.count(key)) {
      list.arr[seen[key]]["count"].num += 1;
      continue;
    }
    seen[key] = list.arr.size();
    double ms = median_ms(stream_, [&] { c.run(handle_, stream_); }, reps, 3);
    ladder::Json j = ladder::Json::object();
    j["layer"] = c.name();
    j["count"] = 1;
    j["shape"] = s.str();
    const std::pair<const char*, int> dims[] = {{"n", s.n}, {"c", s.c}, {"h", s.h}, {"w", s.w}, {"k", s.k},
                                                {"r", s.r}, {"s", s.s}, {"stride", s.stride}, {"pad", s.pad},
                                                {"p", s.p()}, {"q", s.q()}};
    for (auto& d : dims) j[d.first] = d.second;
    j["epilogue"] = epilogue_name(c.spec().epilogue);
    j["dtype"] = o_.precision.name;
    j["layout"] = o_.nhwc ? "NHWC" : "NCHW";
    for (auto& kv : c.plan().stats().obj) j[kv.first] = kv.second;
    j["median_ms"] = ms;
    j["tflops"] = s.flops() / (ms * 1e-3) / 1e12;
    list.push_back(j);
  }
  return list;
}

}  // namespace rung
