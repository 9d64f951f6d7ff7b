#include "net.h"

#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>

#include "kernels.h"

namespace rung {

struct ResNet50::Pool {
  int in, out;
  cudnnPoolingDescriptor_t desc = nullptr;
  cudnnTensorDescriptor_t x = nullptr, y = nullptr;
  ~Pool() {
    if (y) cudnnDestroyTensorDescriptor(y);
    if (x) cudnnDestroyTensorDescriptor(x);
    if (desc) cudnnDestroyPoolingDescriptor(desc);
  }
};

namespace {

// Engine tables: one choice per line, "key<TAB>fused<TAB>heuristic mode<TAB>position"; later files win.
std::map<std::string, EngineChoice> read_engine_tables(const std::vector<std::string>& paths) {
  std::map<std::string, EngineChoice> table;
  for (const std::string& path : paths) {
    std::ifstream in(path);
    std::string line;
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string key;
      EngineChoice c{};
      int fused = 0;
      if (std::getline(fields, key, '\t') && fields >> fused >> c.heur_mode >> c.heur_index) {
        c.fused = fused != 0;
        table[key] = c;
      }
    }
  }
  return table;
}

// One line per write, appended: a later process of the run reuses the choice.
void append_engine_choice(const std::string& path, const std::string& key, const EngineChoice& c) {
  if (path.empty()) return;
  std::ofstream(path, std::ios::app) << key << '\t' << int(c.fused) << '\t' << c.heur_mode << '\t' << c.heur_index
                                     << '\n' << std::flush;
}

constexpr double kBnEps = 1e-5;  // torchvision's BatchNorm2d default

std::string shape_str(const std::vector<int64_t>& s) {
  std::string o = "[";
  for (size_t i = 0; i < s.size(); ++i) o += (i ? ", " : "") + std::to_string(s[i]);
  return o + "]";
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

  // The network, as shapes. Tensor-core kernels want 16-byte channel vectors, so the stem's 3 input channels are
  // zero-padded to 16 bytes' worth in NHWC (zero taps: same result).
  const int c_in = o_.nhwc && p.tensor_cores() ? int(16 / p.bytes) : 3;
  acts_.push_back({c_in, o_.res, o_.res});
  int x = add_conv("conv1", "bn1", 0, 64, 7, 2, 3, Epilogue::BiasRelu);
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
    fold(weights, d.name, d.bn, d.spec.shape, d.in == 0 ? 3 : d.spec.shape.c, o_.nhwc, w, b);
    offsets.emplace_back(arena.add(w), arena.add(b));
  }
  const int features = acts_[x].c, classes = 1000;
  size_t fc_w = arena.add(weight(weights, "fc.weight", {classes, features}).data);
  size_t fc_b = arena.add(weight(weights, "fc.bias", {classes}).data);
  weights_ = DeviceBuffer(arena.data().size());
  LADDER_CUDA(cudaMemcpy(weights_.get(), arena.data().data(), arena.data().size(), cudaMemcpyHostToDevice));
  auto wptr = [&](size_t off) { return static_cast<const char*>(weights_.get()) + off; };

  // Input: the contract's fp32 NCHW converted once into this rung's dtype and layout.
  input_ = DeviceBuffer(size_t(o_.batch) * c_in * o_.res * o_.res * p.bytes);
  acts_[0].ptr = input_.get();
  if (o_.nhwc) {
    DeviceBuffer staging(input.data.size() * sizeof(float));
    LADDER_CUDA(cudaMemcpy(staging.get(), input.data.data(), staging.bytes(), cudaMemcpyHostToDevice));
    nchw_to_nhwc(static_cast<const float*>(staging.get()), input_.get(), p.storage, o_.batch, 3, o_.res, o_.res,
                 c_in, stream_);
    LADDER_CUDA(cudaStreamSynchronize(stream_));
  } else {
    LADDER_CUDA(cudaMemcpy(input_.get(), input.data.data(), input_.bytes(), cudaMemcpyHostToDevice));
  }
  output_ = DeviceBuffer(size_t(o_.batch) * classes * p.bytes);
  plan_memory(stats);

  // Tune each distinct (shape, epilogue) once; layers that repeat it share the plan.
  double t0 = ladder::now_s();
  size_t workspace = 0;
  {
    TuningWorkspace scratch(o_.workspace_limit);
    std::map<std::string, std::shared_ptr<ConvPlan>> tuned;
    // Engine tables: the key names everything a choice depends on besides the GPU model (the table's folder).
    const std::string prefix = "cudnn" + std::to_string(cudnnGetVersion()) + " " + p.name + (o_.nhwc ? " nhwc " : " nchw ");
    std::map<std::string, EngineChoice> table = read_engine_tables(o_.engine_tables);
    int from_table = 0;
    for (size_t i = 0; i < defs_.size(); ++i) {
      const ConvDef& d = defs_[i];
      ConvIO io{acts_[d.in].ptr, wptr(offsets[i].first), wptr(offsets[i].second),
                d.residual >= 0 ? acts_[d.residual].ptr : nullptr, acts_[d.out].ptr};
      std::string key = d.spec.shape.str() + " " + epilogue_name(d.spec.epilogue);
      auto& plan = tuned[key];
      auto known = table.find(prefix + key);
      if (!plan && known != table.end()) {
        plan = plan_from_choice(handle_, d.spec, io, scratch, known->second);
        from_table += bool(plan);
      }
      if (!plan) {
        plan = tune_conv(handle_, d.spec, io, scratch, o_.candidates, stream_);
        append_engine_choice(o_.engine_table_out, prefix + key, {plan->fused, plan->heur_mode, plan->heur_index});
      }
      workspace = std::max(workspace, size_t(plan->workspace));
      convs_.emplace_back(d.name, d.spec, io, plan);
    }
    fc_ = std::make_unique<Linear>(p, o_.batch, features, classes, wptr(fc_w), wptr(fc_b), acts_[x].ptr,
                                   output_.get(), scratch, stream_);
    workspace = std::max(workspace, fc_->workspace());
    stats["distinct_conv_plans"] = int(tuned.size());
    stats["conv_plans_from_engine_tables"] = from_table;
    ladder::Json tables = ladder::Json::array();
    for (const std::string& t : o_.engine_tables) tables.push_back(t);
    stats["engine_tables"] = tables;
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
  stats["input_channels"] = c_in;
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
                       Epilogue e, int residual) {
  const Act a = acts_[in];
  ConvShape s{o_.batch, a.c, a.h, a.w, k, r, r, stride, pad};
  acts_.push_back({k, s.p(), s.q()});
  const int out = int(acts_.size()) - 1;
  defs_.push_back({conv, bn, in, out, residual, ConvSpec{s, e, &o_.precision, o_.nhwc}});
  std::vector<int> reads = {in};
  if (residual >= 0) reads.push_back(residual);
  steps_.push_back({Step::Conv, int(defs_.size()) - 1, reads, out});
  return out;
}

int ResNet50::add_pool(int in, bool max, int window, int stride, int pad) {
  const Act a = acts_[in];
  const int h = (a.h + 2 * pad - window) / stride + 1, w = (a.w + 2 * pad - window) / stride + 1;
  acts_.push_back({a.c, h, w});
  auto pool = std::make_unique<Pool>();
  pool->in = in;
  pool->out = int(acts_.size()) - 1;
  const cudnnTensorFormat_t format = o_.nhwc ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW;
  CUDNN_CHECK(cudnnCreatePoolingDescriptor(&pool->desc));
  // Max pooling ignores the padding (PyTorch pads with -inf); the average pool has no padding.
  CUDNN_CHECK(cudnnSetPooling2dDescriptor(pool->desc, max ? CUDNN_POOLING_MAX : CUDNN_POOLING_AVERAGE_COUNT_EXCLUDE_PADDING,
                                          CUDNN_NOT_PROPAGATE_NAN, window, window, pad, pad, stride, stride));
  CUDNN_CHECK(cudnnCreateTensorDescriptor(&pool->x));
  CUDNN_CHECK(cudnnSetTensor4dDescriptor(pool->x, format, o_.precision.cudnn, o_.batch, a.c, a.h, a.w));
  CUDNN_CHECK(cudnnCreateTensorDescriptor(&pool->y));
  CUDNN_CHECK(cudnnSetTensor4dDescriptor(pool->y, format, o_.precision.cudnn, o_.batch, a.c, h, w));
  pools_.push_back(std::move(pool));
  steps_.push_back({Step::Pooling, int(pools_.size()) - 1, {in}, int(acts_.size()) - 1});
  return int(acts_.size()) - 1;
}

// Activation memory plan: each step's output takes a buffer whose previous tenant is dead (last read by an earlier
// step), the smallest that fits, else the largest free one grown; a new buffer only when none is free. An output
// never shares with the step's own inputs, so no kernel reads what it overwrites.
void ResNet50::plan_memory(ladder::Json& stats) {
  for (size_t i = 0; i < steps_.size(); ++i)
    for (int r : steps_[i].reads) acts_[r].last_use = int(i);
  struct Buffer { size_t bytes = 0; int tenant = -1; };
  std::vector<Buffer> buffers;
  std::vector<int> home(acts_.size(), -1);
  for (size_t i = 0; i < steps_.size(); ++i) {
    const int out = steps_[i].writes;
    if (out < 0) continue;  // the classifier writes the rung's output buffer
    const Act& a = acts_[out];
    const size_t need = align_up(size_t(o_.batch) * a.c * a.h * a.w * o_.precision.bytes);
    int pick = -1;
    for (int j = 0; j < int(buffers.size()); ++j) {
      if (buffers[j].tenant >= 0 && acts_[buffers[j].tenant].last_use >= int(i)) continue;  // still live
      if (pick < 0) { pick = j; continue; }
      const bool fits = buffers[j].bytes >= need, pick_fits = buffers[pick].bytes >= need;
      if (fits ? (!pick_fits || buffers[j].bytes < buffers[pick].bytes)
               : (!pick_fits && buffers[j].bytes > buffers[pick].bytes))
        pick = j;
    }
    if (pick < 0) {
      buffers.emplace_back();
      pick = int(buffers.size()) - 1;
    }
    buffers[pick].bytes = std::max(buffers[pick].bytes, need);
    buffers[pick].tenant = out;
    home[out] = pick;
  }
  std::vector<size_t> base;
  size_t total = 0;
  ladder::Json sizes = ladder::Json::array();
  for (const Buffer& b : buffers) {
    base.push_back(total);
    total += b.bytes;
    sizes.push_back(ladder::Json(static_cast<unsigned long long>(b.bytes)));
  }
  activations_ = DeviceBuffer(total);
  for (size_t a = 0; a < acts_.size(); ++a)
    if (home[a] >= 0) acts_[a].ptr = static_cast<char*>(activations_.get()) + base[home[a]];
  ladder::Json plan = ladder::Json::object();
  plan["buffers"] = sizes;
  plan["activation_bytes"] = static_cast<unsigned long long>(total);
  stats["memory_plan"] = plan;
}

void ResNet50::issue() const {
  const float one = 1.f, zero = 0.f;
  for (const Step& s : steps_) {
    switch (s.kind) {
      case Step::Conv: convs_[s.index].run(handle_, stream_); break;
      case Step::Pooling: {
        const Pool& p = *pools_[s.index];
        CUDNN_CHECK(cudnnPoolingForward(handle_, p.desc, &one, p.x, acts_[p.in].ptr, &zero, p.y, acts_[p.out].ptr));
        break;
      }
      case Step::Fc: fc_->run(stream_); break;
    }
  }
}

std::vector<float> ResNet50::output_fp32() const {
  std::vector<uint8_t> host(output_.bytes());
  LADDER_CUDA(cudaMemcpyAsync(host.data(), output_.get(), host.size(), cudaMemcpyDeviceToHost, stream_));
  LADDER_CUDA(cudaStreamSynchronize(stream_));
  return decode(host.data(), host.size() / o_.precision.bytes, o_.precision.storage);
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
    const std::string key = s.str() + " " + epilogue_name(c.spec().epilogue);
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
