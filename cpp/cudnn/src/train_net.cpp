#include "train_net.h"

#include <algorithm>
#include <map>

#include "checks.h"
#include "gpu_timing.h"
#include "inference_kernels.h"
#include "memory_plan.h"
#include "pool_kernels.h"

namespace rung {
namespace {

constexpr float kBnMomentum = 0.1f;                       // torchvision's BatchNorm2d default
constexpr float kSgdMomentum = 0.9f, kWeightDecay = 1e-4f;  // core/train.py MOMENTUM, WEIGHT_DECAY
constexpr int kLossHistory = 64;  // the losses of the first steps kept for the output file

// f(PyTorch's KCRS offset, our KRSC offset with `padded` input channels) for each element of a [k, c, r, r] filter.
template <typename F>
void each_filter_element(const std::vector<int64_t>& shape, int64_t padded, F&& f) {
  const int64_t k = shape[0], c = shape[1], r = shape[2];
  for (int64_t o = 0; o < k; ++o)
    for (int64_t i = 0; i < c; ++i)
      for (int64_t y = 0; y < r; ++y)
        for (int64_t x = 0; x < r; ++x)
          f(size_t(((o * c + i) * r + y) * r + x), size_t(((o * r + y) * r + x) * padded + i));
}

}  // namespace

struct ResNet50Train::Param {
  std::string name;            // PyTorch's: conv1.weight, layer1.0.bn1.bias, fc.weight...
  std::vector<int64_t> shape;  // PyTorch's
  int padded_channels;         // a filter's input channels as laid out (KRSC); 0: not a filter
  int64_t n;                   // elements as laid out
  size_t master;               // float offset into master_ and momentum_
  size_t grad, copy;           // byte offsets into grads_ and copies_
  bool has_copy;               // the forward reads a storage-type copy (16-bit runs)
  Storage grad_type;
};

struct ResNet50Train::ConvUnit {
  std::string name;
  ConvShape shape;
  int w, x, y;
  int stats;  // the forward's statistics of y, for the BatchNorm after it (ConvIO::stats)
  int dx = -1, dy = -1;
  int dx_plus = -1;  // a gradient the data gradient adds to its own (the residual's other branch), or -1
  // By Pass (forward, data gradient, weight gradient): the tuned plan, the layer bound to the final arena, and the
  // plan's workspace (a buffer of the memory plan, or -1).
  std::array<std::shared_ptr<ConvPlan>, 3> plans = {};
  std::array<std::unique_ptr<ConvLayer>, 3> layers = {};
  std::array<int, 3> workspaces = {-1, -1, -1};
};

// Floats per channel of a BatchNorm in bn_state_: running mean and variance, the saved mean and 1/std, and the
// forward's scale and shift (from which the backward recomputes the ReLU's mask where no residual was added).
constexpr int kBnStateFloats = 6;

struct ResNet50Train::BnUnit {
  std::string name;
  int channels, x, y, z;  // z: the residual added before the ReLU, or -1
  int conv;               // the convolution whose output x is (it made x's statistics)
  bool relu;
  int gamma, beta;
  size_t state;  // float offset into bn_state_: running mean, running variance, saved mean, saved 1/std
  int dy = -1, dx = -1, dz = -1;
};

// The average pool by cuDNN (PoolDesc's x and y are its descriptors); the max pool by our kernels (`shape`), which
// keep each output's window position (`where`: a byte per element) for the backward.
struct ResNet50Train::PoolUnit : PoolDesc {
  PoolUnit(bool max_, int window, int stride, int pad, const Precision& p, int n, int c, int h, int w)
      : PoolDesc(max_, window, stride, pad, p, true, n, c, h, w), max(max_),
        shape{n, c, h, w, window, stride, pad, out_h, out_w} {}
  bool max;
  PoolShape shape;
  int input = -1, output = -1, dinput = -1, doutput = -1, where = -1;
};

ResNet50Train::ResNet50Train(const NetOptions& o, float lr, const ladder::TensorMap& weights,
                             const ladder::HostTensor& input, cudaStream_t stream, ladder::Json& stats)
    : o_(o), lr_(lr), stream_(stream) {
  const Precision& p = o_.precision;
  if (!o_.nhwc) throw std::runtime_error("the cudnn rung trains channels-last only (its BatchNorm kernels are NHWC)");
  if (!weights.count("fc.weight") || weights.at("fc.weight").shape.size() != 2)
    throw std::runtime_error("the weights file has no classifier fc.weight [classes, features]");
  classes_ = int(weights.at("fc.weight").shape[0]);
  CUDNN_CHECK(cudnnCreate(&handle_));
  CUDNN_CHECK(cudnnSetStream(handle_, stream_));

  // The forward, in torchvision's order (v1.5 bottlenecks: the stride on the 3x3; the block's branch, then its
  // projection), then the backward in reverse, then SGD: one schedule, one memory plan.
  c_in_ = p.tensor_cores() ? int(16 / p.bytes) : 3;
  const int x0 = tensor(c_in_, o_.res, o_.res);
  int x = pool(bn("bn1", conv("conv1", x0, 64, 7, 2, 3), true), true, 3, 2, 1);
  const int stem_pool = int(pools_.size()) - 1;
  struct BlockUnits { int conv1, bn1, conv2, bn2, conv3, bn3, proj_conv = -1, proj_bn = -1; };
  std::vector<BlockUnits> blocks;
  const int widths[] = {64, 128, 256, 512}, counts[] = {3, 4, 6, 3};
  for (int l = 0; l < 4; ++l)
    for (int b = 0; b < counts[l]; ++b) {
      const std::string name = "layer" + std::to_string(l + 1) + "." + std::to_string(b) + ".";
      const int width = widths[l], stride = b == 0 && l > 0 ? 2 : 1;
      BlockUnits u{};
      int t = bn(name + "bn1", conv(name + "conv1", x, width, 1, 1, 0), true);
      u.conv1 = int(convs_.size()) - 1, u.bn1 = int(bns_.size()) - 1;
      t = bn(name + "bn2", conv(name + "conv2", t, width, 3, stride, 1), true);
      u.conv2 = int(convs_.size()) - 1, u.bn2 = int(bns_.size()) - 1;
      const int c3 = conv(name + "conv3", t, width * 4, 1, 1, 0);
      u.conv3 = int(convs_.size()) - 1;
      int skip = x;
      if (b == 0) {
        skip = bn(name + "downsample.1", conv(name + "downsample.0", x, width * 4, 1, stride, 0), false);
        u.proj_conv = int(convs_.size()) - 1, u.proj_bn = int(bns_.size()) - 1;
      }
      x = bn(name + "bn3", c3, true, skip);
      u.bn3 = int(bns_.size()) - 1;
      blocks.push_back(u);
    }
  const Tensor last = tensors_[x];
  pooled_ = pool(x, false, last.h, last.h, 0);
  const int features = last.c;
  fc_w_ = param("fc.weight", {classes_, features}, p.storage != Storage::F32);
  fc_b_ = param("fc.bias", {classes_}, p.storage != Storage::F32);
  logits_ = tensor(classes_, 1, 1);
  steps_.push_back({Kind::FcForward, 0, {pooled_}, {logits_}});
  dlogits_ = tensor(classes_, 1, 1);
  steps_.push_back({Kind::Loss, 0, {logits_}, {dlogits_}});

  steps_.push_back({Kind::FcWgrad, 0, {pooled_, dlogits_}, {}});
  steps_.push_back({Kind::FcBias, 0, {dlogits_}, {}});
  dpooled_ = tensor(features, 1, 1);
  steps_.push_back({Kind::FcDgrad, 0, {dlogits_}, {dpooled_}});
  int dy = pool_backward(int(pools_.size()) - 1, dpooled_);
  for (auto u = blocks.rbegin(); u != blocks.rend(); ++u) {
    int d = bn_backward(u->bn3, dy);
    const int dskip = bns_[u->bn3].dz;
    d = bn_backward(u->bn2, conv_backward(u->conv3, d, true));
    d = bn_backward(u->bn1, conv_backward(u->conv2, d, true));
    const int shortcut = u->proj_conv < 0 ? dskip : conv_backward(u->proj_conv, bn_backward(u->proj_bn, dskip), true);
    dy = conv_backward(u->conv1, d, true, shortcut);  // the block input's gradient: both branches' sum
  }
  conv_backward(0, bn_backward(0, pool_backward(stem_pool, dy)), false);  // no gradient for the input
  steps_.push_back({Kind::Sgd, 0, {}, {}});

  place_parameters(weights);

  // Input: the contract's fp32 NCHW converted once into the storage type, NHWC (autocast's cast of the input);
  // labels: core/train.py's, until a batch of data brings its own.
  input_ = DeviceBuffer(size_t(o_.batch) * c_in_ * o_.res * o_.res * p.bytes);
  tensors_[x0].ptr = input_.get();
  upload_input(input);
  std::vector<int> labels(o_.batch);
  for (int row = 0; row < o_.batch; ++row) labels[row] = int((int64_t(row) * 7919) % classes_);
  labels_ = DeviceBuffer(labels.size() * sizeof(int));
  upload(labels_.get(), labels.data(), labels_.bytes(), stream_);

  // The loss: per row, the last step's, the first steps', and how many steps ran.
  loss_ = DeviceBuffer(align_up(sizeof(float)) + align_up(size_t(o_.batch) * sizeof(float)) +
                       align_up(kLossHistory * sizeof(float)) + sizeof(int));
  char* base = static_cast<char*>(loss_.get());
  row_loss_ = reinterpret_cast<float*>(base + align_up(sizeof(float)));
  history_ = reinterpret_cast<float*>(base + align_up(sizeof(float)) + align_up(size_t(o_.batch) * sizeof(float)));
  count_ = reinterpret_cast<int*>(reinterpret_cast<char*>(history_) + align_up(kLossHistory * sizeof(float)));

  x0_ = x0;
  ladder::Json memory_plan = ladder::Json::object();
  place_activations(memory_plan);  // a first arena, for tuning: each convolution pass is timed on real buffers
  tune_convolutions(stats);
  // Then the plan again, each convolution step's workspace in it, live during that step alone: at the step's peak
  // (the backward's start) the passes running need little, where one workspace for all held the largest any needs
  // (1.6 GiB in strict fp32 at batch 256).
  int64_t largest_workspace = 0;
  for (Step& s : steps_) {
    const int pass = conv_pass(s.kind);
    if (pass < 0) continue;
    ConvUnit& u = convs_[s.unit];
    const int64_t need = u.plans[pass]->workspace;
    if (need > 0) s.writes.push_back(u.workspaces[pass] = buffer(size_t(need)));
    largest_workspace = std::max(largest_workspace, need);
  }
  memory_plan["conv_workspace_largest_bytes"] = static_cast<long long>(largest_workspace);
  place_activations(memory_plan);
  stats["memory_plan"] = memory_plan;
  build_kernels(stats);
  reset();  // tuning ran the convolutions on the first arena's buffers: start from the weights file
}

// One allocation for every activation, gradient and buffer of the step, by the memory plan over the schedule.
void ResNet50Train::place_activations(ladder::Json& memory_plan) {
  std::vector<size_t> bytes;
  for (const Tensor& t : tensors_)
    bytes.push_back(align_up(t.bytes ? t.bytes : size_t(o_.batch) * t.c * t.h * t.w * o_.precision.bytes));
  bytes[x0_] = 0;  // the input has its own buffer
  std::vector<PlannedStep> planned;
  for (const Step& s : steps_) planned.push_back({s.reads, s.writes, s.in_place});
  const MemoryPlan plan = plan_memory(bytes, planned);
  activations_ = DeviceBuffer();  // the first arena goes before the second comes
  activations_ = DeviceBuffer(plan.total);
  for (size_t t = 0; t < tensors_.size(); ++t)
    if (plan.offsets[t] >= 0) tensors_[t].ptr = static_cast<char*>(activations_.get()) + plan.offsets[t];
  memory_plan["tensors"] = int(tensors_.size());
  memory_plan["activation_bytes"] = static_cast<unsigned long long>(plan.total);
  memory_plan["peak_live_bytes"] = static_cast<unsigned long long>(plan.peak_live);
}

ResNet50Train::~ResNet50Train() {
  convs_.clear();
  pools_.clear();
  if (handle_) cudnnDestroy(handle_);
}

int ResNet50Train::tensor(int c, int h, int w) {
  tensors_.push_back({c, h, w});
  return int(tensors_.size()) - 1;
}

int ResNet50Train::buffer(size_t bytes) {
  tensors_.push_back({0, 0, 0, nullptr, bytes});
  return int(tensors_.size()) - 1;
}

int ResNet50Train::param(const std::string& name, std::vector<int64_t> shape, bool low_precision_copy,
                         int padded_channels) {
  int64_t n = 1;
  for (size_t i = 0; i < shape.size(); ++i) n *= i == 1 && padded_channels ? padded_channels : shape[i];
  const size_t master = params_.empty() ? 0 : params_.back().master + align_up(params_.back().n, 64);
  const Storage grad_type = low_precision_copy ? o_.precision.storage : Storage::F32;
  params_.push_back({name, std::move(shape), padded_channels, n, master, 0, 0, low_precision_copy, grad_type});
  return int(params_.size()) - 1;
}

int ResNet50Train::conv(const std::string& name, int x, int k, int r, int stride, int pad) {
  const Tensor a = tensors_[x];
  const ConvShape s{o_.batch, a.c, a.h, a.w, k, r, r, stride, pad};
  const int true_channels = name == "conv1" ? 3 : a.c;  // the stem's input is zero-padded
  const int w = param(name + ".weight", {k, true_channels, r, r}, o_.precision.storage != Storage::F32, a.c);
  const int y = tensor(k, s.p(), s.q());
  // Room for either form of the statistics: bn_statistics' partials, never fewer than genstats' 2 floats a channel.
  const int64_t rows = int64_t(o_.batch) * s.p() * s.q();
  const int stats = buffer(BnGrid::for_shape(rows, k).scratch_floats(k) * sizeof(float));
  convs_.push_back({name, s, w, x, y, stats});
  steps_.push_back({Kind::ConvFprop, int(convs_.size()) - 1, {x}, {y, stats}});
  return y;
}

int ResNet50Train::bn(const std::string& name, int x, bool relu, int z) {
  const Tensor a = tensors_[x];
  const int y = tensor(a.c, a.h, a.w);
  const size_t state = bns_.empty() ? 0 : bns_.back().state + kBnStateFloats * size_t(bns_.back().channels);
  const auto conv = std::find_if(convs_.begin(), convs_.end(), [&](const ConvUnit& u) { return u.y == x; });
  if (conv == convs_.end()) throw std::logic_error("BatchNorm " + name + " does not follow a convolution");
  bns_.push_back({name, a.c, x, y, z, int(conv - convs_.begin()), relu, param(name + ".weight", {a.c}, false),
                  param(name + ".bias", {a.c}, false), state});
  std::vector<int> reads = {x, conv->stats};
  if (z >= 0) reads.push_back(z);
  steps_.push_back({Kind::BnForward, int(bns_.size()) - 1, reads, {y}});
  return y;
}

int ResNet50Train::pool(int x, bool max, int window, int stride, int pad) {
  const Tensor a = tensors_[x];
  auto unit = std::make_unique<PoolUnit>(max, window, stride, pad, o_.precision, o_.batch, a.c, a.h, a.w);
  unit->input = x;
  unit->output = tensor(a.c, unit->out_h, unit->out_w);
  std::vector<int> writes = {unit->output};
  if (max) writes.push_back(unit->where = buffer(size_t(o_.batch) * unit->out_h * unit->out_w * a.c));
  steps_.push_back({Kind::PoolForward, int(pools_.size()), {x}, writes});
  pools_.push_back(std::move(unit));
  return pools_.back()->output;
}

int ResNet50Train::conv_backward(int unit, int dy, bool data, int dx_plus) {
  ConvUnit& u = convs_[unit];
  u.dy = dy;
  steps_.push_back({Kind::ConvWgrad, unit, {u.x, dy}, {}});
  if (!data) return -1;
  const Tensor a = tensors_[u.x];
  u.dx = tensor(a.c, a.h, a.w);
  u.dx_plus = dx_plus;
  std::vector<int> reads = {dy};
  if (dx_plus >= 0) reads.push_back(dx_plus);
  steps_.push_back({Kind::ConvDgrad, unit, reads, {u.dx}});
  return u.dx;
}

int ResNet50Train::bn_backward(int unit, int dy) {
  BnUnit& u = bns_[unit];
  const Tensor a = tensors_[u.x];
  u.dy = dy;
  u.dx = tensor(a.c, a.h, a.w);
  std::vector<int> reads = {dy, u.x}, writes = {u.dx};
  if (u.relu && u.z >= 0) reads.push_back(u.y);  // without a residual the mask comes from x (bn_backward)
  if (u.z >= 0) writes.push_back(u.dz = tensor(a.c, a.h, a.w));
  steps_.push_back({Kind::BnBackward, unit, reads, writes, {{u.dx, dy}}});
  return u.dx;
}

int ResNet50Train::pool_backward(int unit, int dy) {
  PoolUnit& u = *pools_[unit];
  const Tensor a = tensors_[u.input];
  u.doutput = dy;
  u.dinput = tensor(a.c, a.h, a.w);
  const std::vector<int> reads = u.max ? std::vector<int>{dy, u.where} : std::vector<int>{dy, u.input, u.output};
  steps_.push_back({Kind::PoolBackward, unit, reads, {u.dinput}});
  return u.dinput;
}

// fp32 master weights (filters as KRSC, input channels zero-padded), zero momentum, the storage-type copies the
// forward reads, the gradients' arena, and BatchNorm's running statistics from the weights file.
void ResNet50Train::place_parameters(const ladder::TensorMap& weights) {
  const Precision& p = o_.precision;
  const Param& last = params_.back();
  std::vector<float> host(last.master + align_up(last.n, 64), 0.f);
  size_t grads = 0, copies = 0;
  for (Param& q : params_) {
    const std::vector<float>& src = weight(weights, q.name, q.shape).data;
    if (q.padded_channels) {
      each_filter_element(q.shape, q.padded_channels,
                          [&](size_t kcrs, size_t krsc) { host[q.master + krsc] = src[kcrs]; });
    } else {
      std::copy(src.begin(), src.end(), host.begin() + q.master);
    }
    q.grad = grads;
    grads += align_up(q.n * (q.grad_type == Storage::F32 ? 4 : 2));
    q.copy = copies;
    if (q.has_copy) copies += align_up(q.n * p.bytes);
  }
  master_ = DeviceBuffer(host.size() * sizeof(float));
  momentum_ = DeviceBuffer(host.size() * sizeof(float));
  grads_ = DeviceBuffer(grads);
  if (copies) {
    copies_ = DeviceBuffer(copies);
    initial_copies_.resize(copies);
    for (const Param& q : params_) {
      if (!q.has_copy) continue;
      std::vector<uint8_t> bytes = encode({host.begin() + q.master, host.begin() + q.master + q.n}, p.storage);
      std::copy(bytes.begin(), bytes.end(), initial_copies_.begin() + q.copy);
    }
  }
  initial_master_ = std::move(host);
  const BnUnit& tail = bns_.back();
  std::vector<float> state(tail.state + kBnStateFloats * tail.channels, 0.f);
  for (const BnUnit& b : bns_) {
    const std::vector<int64_t> shape = {b.channels};
    const auto& mean = weight(weights, b.name + ".running_mean", shape).data;
    const auto& var = weight(weights, b.name + ".running_var", shape).data;
    std::copy(mean.begin(), mean.end(), state.begin() + b.state);
    std::copy(var.begin(), var.end(), state.begin() + b.state + b.channels);
    const BnGrid grid = BnGrid::for_shape(int64_t(o_.batch) * tensors_[b.x].h * tensors_[b.x].w, b.channels);
    bn_scratch_floats_ = std::max(bn_scratch_floats_, grid.scratch_floats(b.channels));
    max_channels_ = std::max(max_channels_, b.channels);
  }
  bn_state_ = DeviceBuffer(state.size() * sizeof(float));
  initial_bn_state_ = std::move(state);
  bn_scratch_ = DeviceBuffer((bn_scratch_floats_ + kBnCoefs * size_t(max_channels_)) * sizeof(float));

  std::vector<SgdTensor> sgd;
  auto* master = static_cast<float*>(master_.get());
  auto* momentum = static_cast<float*>(momentum_.get());
  for (const Param& q : params_)
    sgd.push_back({master + q.master, momentum + q.master, static_cast<char*>(grads_.get()) + q.grad,
                   q.has_copy ? static_cast<char*>(copies_.get()) + q.copy : nullptr, q.n, q.grad_type,
                   p.storage});
  sgd_ = std::make_unique<Sgd>(sgd);
}

void ResNet50Train::reset() {
  LADDER_CUDA(cudaStreamSynchronize(stream_));
  upload(master_.get(), initial_master_.data(), master_.bytes(), stream_);
  if (!initial_copies_.empty())
    upload(copies_.get(), initial_copies_.data(), copies_.bytes(), stream_);
  upload(bn_state_.get(), initial_bn_state_.data(), bn_state_.bytes(), stream_);
  LADDER_CUDA(cudaMemsetAsync(momentum_.get(), 0, momentum_.bytes(), stream_));
  LADDER_CUDA(cudaMemsetAsync(count_, 0, sizeof(int), stream_));
  LADDER_CUDA(cudaStreamSynchronize(stream_));
}

// A convolution step's pass (Pass as an index), or -1.
int ResNet50Train::conv_pass(Kind k) {
  return k == Kind::ConvFprop ? int(Pass::Fprop) : k == Kind::ConvDgrad ? int(Pass::Dgrad)
       : k == Kind::ConvWgrad ? int(Pass::Wgrad) : -1;
}

// The weights the forward reads (the storage-type copy in 16-bit runs, else the fp32 master) and the gradient.
void* ResNet50Train::weights_of(int q) const {
  const Param& w = params_[q];
  return w.has_copy ? static_cast<char*>(copies_.get()) + w.copy
                    : static_cast<void*>(static_cast<float*>(master_.get()) + w.master);
}

void* ResNet50Train::grad_of(int q) const { return static_cast<char*>(grads_.get()) + params_[q].grad; }

// The pointers each convolution pass reads and writes, in the current arena.
std::array<ConvIO, 3> ResNet50Train::conv_io(const ConvUnit& u) const {
  const void* weights = weights_of(u.w);
  void* grad = grad_of(u.w);
  auto at = [&](int t) { return t >= 0 ? tensors_[t].ptr : nullptr; };
  return {ConvIO{at(u.x), weights, nullptr, nullptr, at(u.y), static_cast<float*>(at(u.stats))},
          ConvIO{at(u.dx), weights, nullptr, at(u.dx_plus), at(u.dy)},
          ConvIO{at(u.x), grad, nullptr, nullptr, at(u.dy)}};
}

ConvSpec ResNet50Train::conv_spec(const ConvUnit& u, Pass pass) const {
  const Epilogue e = pass == Pass::Fprop ? Epilogue::Stats : pass == Pass::Dgrad && u.dx_plus >= 0 ? Epilogue::Add
                                                                                                  : Epilogue::None;
  return {u.shape, e, &o_.precision, true, pass};
}

// Each convolution pass's plan (tuned on its real buffers, or from the engine tables), kept pointer-free.
void ResNet50Train::tune_convolutions(ladder::Json& stats) {
  const double t0 = ladder::now_s();
  ConvPlanner planner(handle_, o_.engine(), stream_);
  for (ConvUnit& u : convs_) {
    const std::array<ConvIO, 3> io = conv_io(u);
    for (Pass pass : {Pass::Fprop, Pass::Dgrad, Pass::Wgrad})
      if (pass != Pass::Dgrad || u.dx >= 0) u.plans[int(pass)] = planner.plan(conv_spec(u, pass), io[int(pass)]);
  }
  planner.report(stats);
  stats["autotune_s"] = ladder::now_s() - t0;
}

// The convolution layers bound to the final arena (each to its own workspace there), and the classifier's three
// products tuned, with one small workspace of their own.
void ResNet50Train::build_kernels(ladder::Json& stats) {
  const Precision& p = o_.precision;
  for (ConvUnit& u : convs_) {
    const std::array<ConvIO, 3> io = conv_io(u);
    for (Pass pass : {Pass::Fprop, Pass::Dgrad, Pass::Wgrad}) {
      const int i = int(pass);
      if (!u.plans[i]) continue;
      u.layers[i] = std::make_unique<ConvLayer>(u.name, conv_spec(u, pass), io[i], u.plans[i]);
      u.layers[i]->bind(u.workspaces[i] >= 0 ? tensors_[u.workspaces[i]].ptr : nullptr);
    }
  }
  {
    TuningWorkspace scratch(o_.workspace_limit);
    const int in = tensors_[pooled_].c, n = o_.batch;
    void *g = tensors_[pooled_].ptr, *dg = tensors_[dpooled_].ptr;
    void *logits = tensors_[logits_].ptr, *dlogits = tensors_[dlogits_].ptr;
    fc_forward_ = std::make_unique<Linear>(p, n, in, classes_, weights_of(fc_w_), weights_of(fc_b_), g, logits,
                                           scratch, stream_);
    // dg[N, in] = dlogits[N, out] W[out, in]; dW[out, in] = dlogits^T g (column-major: dg^T = W^T' dlogits^T...).
    fc_dgrad_ = std::make_unique<Gemm>(p, GemmShape{false, false, in, n, classes_, in, classes_, in},
                                       weights_of(fc_w_), dlogits, dg, nullptr, scratch, stream_);
    fc_wgrad_ = std::make_unique<Gemm>(p, GemmShape{false, true, in, classes_, n, in, classes_, in}, g, dlogits,
                                       grad_of(fc_w_), nullptr, scratch, stream_);
  }
  const size_t fc_workspace = std::max({fc_forward_->workspace(), fc_dgrad_->workspace(), fc_wgrad_->workspace()});
  if (fc_workspace) workspace_ = DeviceBuffer(fc_workspace);
  for (Gemm* g : {static_cast<Gemm*>(fc_forward_.get()), fc_dgrad_.get(), fc_wgrad_.get()}) g->bind(workspace_.get());

  ladder::Json convs = ladder::Json::array();
  for (const ConvUnit& u : convs_)
    for (const auto& l : u.layers) {
      if (!l) continue;
      ladder::Json j = ladder::Json::object();
      j["name"] = u.name;
      j["pass"] = pass_name(l->spec().pass);
      j["shape"] = u.shape.str();
      for (auto& kv : l->plan().stats().obj) j[kv.first] = kv.second;
      convs.push_back(j);
    }
  ladder::Json fc = ladder::Json::object();
  fc["forward"] = fc_forward_->stats();
  fc["dgrad"] = fc_dgrad_->stats();
  fc["wgrad"] = fc_wgrad_->stats();
  stats["layout"] = "NHWC";
  stats["input_channels"] = c_in_;
  stats["steps"] = int(steps_.size());
  stats["convs"] = convs;
  stats["fc"] = fc;
  stats["batchnorm"] = "statistics in the convolution's epilogue (cuDNN genstats) or by our Welford pass after it, "
                       "whichever the tuner timed faster (fp32: ours); our kernels: finalize, apply with residual "
                       "add and ReLU fused; backward fused with ReLU's mask";
  stats["optimizer"] = "SGD (momentum 0.9, weight decay 1e-4): one multi-tensor kernel, fp32 master weights";
}

void ResNet50Train::run(const Step& s) const {
  const Precision& p = o_.precision;
  auto ptr = [&](int t) { return t >= 0 ? tensors_[t].ptr : nullptr; };
  auto* master = static_cast<float*>(master_.get());
  auto* scratch = static_cast<float*>(bn_scratch_.get());
  const float one = 1.f, zero = 0.f;
  switch (s.kind) {
    case Kind::ConvFprop:
    case Kind::ConvDgrad:
    case Kind::ConvWgrad: convs_[s.unit].layers[conv_pass(s.kind)]->run(handle_, stream_); break;
    case Kind::BnForward:
    case Kind::BnBackward: {
      const BnUnit& b = bns_[s.unit];
      const Tensor& a = tensors_[b.x];
      const int64_t rows = int64_t(o_.batch) * a.h * a.w;
      float* state = static_cast<float*>(bn_state_.get()) + b.state;
      const float* gamma = master + params_[b.gamma].master;
      const BnGrid grid = BnGrid::for_shape(rows, b.channels);
      if (s.kind == Kind::BnForward) {
        const ConvUnit& conv = convs_[b.conv];
        bn_forward(a.ptr, ptr(b.z), ptr(b.y), b.relu, p.storage, rows, b.channels,
                   static_cast<const float*>(ptr(conv.stats)), conv.layers[int(Pass::Fprop)]->plan().fused, gamma,
                   master + params_[b.beta].master, state, state + b.channels, kBnMomentum, float(kBnEps),
                   state + 2 * b.channels, state + 3 * b.channels, state + 4 * b.channels, stream_);
      } else {
        auto* grads = static_cast<char*>(grads_.get());
        // The ReLU's mask from y where a residual was added before it, else from x and the forward's scale and shift.
        const bool mask_from_y = b.relu && b.z >= 0;
        const float* affine = b.relu && !mask_from_y ? state + 4 * b.channels : nullptr;
        rung::bn_backward(ptr(b.dy), mask_from_y ? ptr(b.y) : nullptr, affine, a.ptr, ptr(b.dx), ptr(b.dz), p.storage,
                          rows, b.channels, gamma, state + 2 * b.channels, state + 3 * b.channels,
                          reinterpret_cast<float*>(grads + params_[b.gamma].grad),
                          reinterpret_cast<float*>(grads + params_[b.beta].grad), scratch + bn_scratch_floats_,
                          scratch, grid, stream_);
      }
      break;
    }
    case Kind::PoolForward: {
      const PoolUnit& u = *pools_[s.unit];
      if (u.max)
        max_pool_forward(ptr(u.input), ptr(u.output), static_cast<uint8_t*>(ptr(u.where)), p.storage, u.shape,
                         false, stream_);
      else
        CUDNN_CHECK(cudnnPoolingForward(handle_, u.desc, &one, u.x, ptr(u.input), &zero, u.y, ptr(u.output)));
      break;
    }
    case Kind::PoolBackward: {
      const PoolUnit& u = *pools_[s.unit];
      if (u.max)
        max_pool_backward(ptr(u.doutput), static_cast<const uint8_t*>(ptr(u.where)), ptr(u.dinput), p.storage,
                          u.shape, stream_);
      else
        CUDNN_CHECK(cudnnPoolingBackward(handle_, u.desc, &one, u.y, ptr(u.output), u.y, ptr(u.doutput), u.x,
                                         ptr(u.input), &zero, u.x, ptr(u.dinput)));
      break;
    }
    case Kind::FcForward: fc_forward_->run(stream_); break;
    case Kind::FcDgrad: fc_dgrad_->run(stream_); break;
    case Kind::FcWgrad: fc_wgrad_->run(stream_); break;
    case Kind::FcBias:
      column_sum(ptr(dlogits_), static_cast<char*>(grads_.get()) + params_[fc_b_].grad, p.storage, o_.batch, classes_,
                 stream_);
      break;
    case Kind::Loss:
      cross_entropy(ptr(logits_), static_cast<const int*>(labels_.get()), ptr(dlogits_), p.storage, o_.batch,
                    classes_, row_loss_, static_cast<float*>(loss_.get()), history_, count_, kLossHistory, stream_);
      break;
    case Kind::Sgd: sgd_->step(lr_, kSgdMomentum, kWeightDecay, stream_); break;
  }
}

void ResNet50Train::issue() const {
  for (const Step& s : steps_) run(s);
}

ladder::TensorMap ResNet50Train::result(int steps) const {
  if (steps > kLossHistory) throw std::runtime_error("at most " + std::to_string(kLossHistory) + " parity steps");
  ladder::TensorMap out = state();
  std::vector<float> losses(steps);
  LADDER_CUDA(cudaMemcpy(losses.data(), history_, steps * sizeof(float), cudaMemcpyDeviceToHost));
  out["loss"] = {{steps}, losses};
  return out;
}

void ResNet50Train::upload_input(const ladder::HostTensor& x) {
  if (x.shape != std::vector<int64_t>{o_.batch, 3, o_.res, o_.res})
    throw std::runtime_error("input has shape " + shape_str(x.shape) + ", expected [batch, 3, res, res]");
  DeviceBuffer staging(x.data.size() * sizeof(float));
  upload(staging.get(), x.data.data(), staging.bytes(), stream_);
  nchw_to_nhwc(static_cast<const float*>(staging.get()), input_.get(), o_.precision.storage, o_.batch, 3, o_.res,
               o_.res, InputLayout{0, 1, o_.res, o_.res, c_in_}, stream_);
  LADDER_CUDA(cudaStreamSynchronize(stream_));  // before the staging buffer goes
}

void ResNet50Train::set_batch(const ladder::HostTensor& x, const std::vector<int>& labels) {
  if (labels.size() != size_t(o_.batch)) throw std::runtime_error("labels for another batch size");
  for (int label : labels)
    if (label < 0 || label >= classes_) throw std::runtime_error("label " + std::to_string(label) + " out of range");
  LADDER_CUDA(cudaStreamSynchronize(stream_));  // the last step has read the buffers
  upload_input(x);
  upload(labels_.get(), labels.data(), labels_.bytes(), stream_);
}

ladder::TensorMap ResNet50Train::state() const {
  LADDER_CUDA(cudaStreamSynchronize(stream_));
  auto download = [](const DeviceBuffer& b) {
    std::vector<float> host(b.bytes() / sizeof(float));
    LADDER_CUDA(cudaMemcpy(host.data(), b.get(), host.size() * sizeof(float), cudaMemcpyDeviceToHost));
    return host;
  };
  ladder::TensorMap out;
  const std::vector<float> master = download(master_), running = download(bn_state_);
  for (const Param& q : params_) {
    ladder::HostTensor t{q.shape, {}};
    if (q.padded_channels) {  // KRSC, padded -> PyTorch's KCRS
      t.data.resize(q.shape[0] * q.shape[1] * q.shape[2] * q.shape[3]);
      each_filter_element(q.shape, q.padded_channels,
                          [&](size_t kcrs, size_t krsc) { t.data[kcrs] = master[q.master + krsc]; });
    } else {
      t.data.assign(master.begin() + q.master, master.begin() + q.master + q.n);
    }
    out["param." + q.name] = std::move(t);
  }
  for (const BnUnit& b : bns_) {
    const auto at = running.begin() + b.state;
    out["buffer." + b.name + ".running_mean"] = {{b.channels}, {at, at + b.channels}};
    out["buffer." + b.name + ".running_var"] = {{b.channels}, {at + b.channels, at + 2 * b.channels}};
  }
  return out;
}

void ResNet50Train::report_memory(ladder::Json& memory) const {
  memory["weights_bytes"] = static_cast<unsigned long long>(master_.bytes() + copies_.bytes());
  memory["gradient_bytes"] = static_cast<unsigned long long>(grads_.bytes());
  memory["optimizer_state_bytes"] = static_cast<unsigned long long>(momentum_.bytes());
  memory["activation_bytes"] = static_cast<unsigned long long>(activations_.bytes());
  memory["workspace_bytes"] = static_cast<unsigned long long>(workspace_.bytes() + bn_scratch_.bytes());
  memory["batchnorm_state_bytes"] = static_cast<unsigned long long>(bn_state_.bytes());
  memory["io_bytes"] = static_cast<unsigned long long>(input_.bytes() + loss_.bytes());
}

std::pair<std::string, std::string> ResNet50Train::step_layer(size_t i) const {
  const Step& s = steps_[i];
  switch (s.kind) {
    case Kind::ConvFprop: case Kind::BnForward: case Kind::PoolForward: case Kind::FcForward:
      return {step_name(s), "forward"};
    case Kind::Loss: return {"loss", "forward"};
    case Kind::Sgd: return {"optimizer", "optimizer"};
    default: return {step_name(s), "backward"};
  }
}

std::string ResNet50Train::step_name(const Step& s) const {
  switch (s.kind) {
    case Kind::ConvFprop: case Kind::ConvDgrad: case Kind::ConvWgrad: return convs_[s.unit].name;
    case Kind::BnForward: case Kind::BnBackward: return bns_[s.unit].name;
    case Kind::PoolForward: case Kind::PoolBackward: return s.unit == 0 ? "maxpool" : "avgpool";
    case Kind::FcForward: case Kind::FcDgrad: case Kind::FcWgrad: case Kind::FcBias: return "fc";
    case Kind::Loss: return "loss";
    case Kind::Sgd: return "sgd";
  }
  return "?";
}

ladder::Json ResNet50Train::norm_prologue_row(const ConvUnit& u, const BnUnit& b, Pass pass, int reps) const {
  ladder::Json j = ladder::Json::object();
  j["layer"] = u.name;
  j["pass"] = pass == Pass::Fprop ? "forward, norm prologue" : "wgrad, norm prologue";
  j["alternative"] = true;  // not part of the step: pass_totals leaves it out of "all"
  j["dtype"] = o_.precision.name;
  const float* state = static_cast<const float*>(bn_state_.get()) + b.state;
  ConvIO io = conv_io(u)[int(pass)];
  io.x = tensors_[b.x].ptr;  // the BatchNorm's input: the normalised activation is made on the fly
  TuningWorkspace ws(o_.workspace_limit);
  std::string reasons;
  for (Prologue prologue : {Prologue::ScaleShiftReluF32, Prologue::ScaleShiftRelu}) {
    DeviceBuffer operands;  // scale and shift in the storage type, for the second form
    io.scale_shift = state + 4 * b.channels;
    if (prologue == Prologue::ScaleShiftRelu) {
      std::vector<float> host(2 * size_t(b.channels));
      LADDER_CUDA(cudaStreamSynchronize(stream_));  // the copy below runs on the legacy stream
      LADDER_CUDA(cudaMemcpy(host.data(), io.scale_shift, host.size() * sizeof(float), cudaMemcpyDeviceToHost));
      const std::vector<uint8_t> encoded = encode(host, o_.precision.storage);
      operands = DeviceBuffer(encoded.size());
      upload(operands.get(), encoded.data(), encoded.size(), stream_);
      io.scale_shift = operands.get();
    }
    ConvSpec spec = conv_spec(u, pass);
    spec.prologue = prologue;
    try {
      std::shared_ptr<ConvPlan> plan = tune_conv(handle_, spec, io, ws, o_.search, stream_);
      ConvLayer layer(u.name, spec, io, plan);
      layer.bind(ws.ensure(size_t(plan->workspace)));
      j["prologue"] = prologue_name(prologue);
      j["median_ms"] = median_ms(stream_, [&] { layer.run(handle_, stream_); }, reps, 3);
      j["shape"] = u.shape.str();
      for (auto& kv : plan->stats().obj) j[kv.first] = kv.second;
      if (!reasons.empty()) j["reason"] = reasons;
      return j;
    } catch (const std::exception& e) {  // no engine runs this form: say why, and try the next
      reasons += std::string(reasons.empty() ? "" : "; ") + prologue_name(prologue) + ": " + e.what();
    }
  }
  j["median_ms"] = ladder::Json();
  j["reason"] = reasons;
  return j;
}

ladder::Json ResNet50Train::micro(int reps) const {
  static const char* const passes[] = {"forward", "dgrad", "wgrad", "forward", "backward", "forward", "backward",
                                       "forward", "dgrad", "wgrad", "bias-grad", "forward+backward", "update"};
  ladder::Json list = ladder::Json::array();
  issue();  // every buffer holds a real step's values
  std::map<std::pair<int, int>, double> step_ms;  // (kind, unit) -> ms, for the probe's rows
  for (const Step& s : steps_) {
    ladder::Json j = ladder::Json::object();
    j["layer"] = step_name(s);
    j["pass"] = passes[int(s.kind)];
    const double ms = median_ms(stream_, [&] { run(s); }, reps, 3);
    step_ms[{int(s.kind), s.unit}] = ms;
    j["median_ms"] = ms;
    double flops = 0;
    const ConvLayer* layer = conv_pass(s.kind) >= 0 ? convs_[s.unit].layers[conv_pass(s.kind)].get() : nullptr;
    switch (s.kind) {
      case Kind::FcForward: flops = fc_forward_->flops(); break;
      case Kind::FcDgrad: flops = fc_dgrad_->flops(); break;
      case Kind::FcWgrad: flops = fc_wgrad_->flops(); break;
      default: break;
    }
    if (layer) {
      flops = layer->spec().shape.flops();
      j["shape"] = layer->spec().shape.str();
      for (auto& kv : layer->plan().stats().obj) j[kv.first] = kv.second;
    }
    j["tflops"] = flops > 0 ? ladder::Json(flops / (ms * 1e-3) / 1e12) : ladder::Json();
    j["dtype"] = o_.precision.name;
    list.push_back(j);
  }
  // MLPerf's norm-conv, probed where it applies: a convolution whose input is a BatchNorm's ReLU with no residual
  // (each block's conv2 and conv3). Forward: it would replace the BatchNorm's apply and the convolution as they run
  // today; weight gradient: it recomputes the activation that the forward no longer writes.
  // Each distinct shape is tuned once (a runtime-compiled engine takes seconds); its row repeats for every layer.
  std::map<std::string, ladder::Json> probed;
  auto probe = [&](const ConvUnit& u, const BnUnit& b, Pass pass, double replaces_ms) {
    const std::string key = u.shape.str() + " " + pass_name(pass);
    auto known = probed.find(key);
    ladder::Json row = known != probed.end() ? known->second : norm_prologue_row(u, b, pass, reps);
    probed.emplace(key, row);
    row["layer"] = u.name;
    row["replaces_ms"] = replaces_ms;
    list.push_back(row);
  };
  if (o_.precision.storage != Storage::F32) {
    for (size_t c = 0; c < convs_.size(); ++c) {
      for (size_t i = 0; i < bns_.size(); ++i) {
        const BnUnit& b = bns_[i];
        if (b.y != convs_[c].x || !b.relu || b.z >= 0) continue;
        const double today = step_ms[{int(Kind::BnForward), int(i)}] + step_ms[{int(Kind::ConvFprop), int(c)}];
        probe(convs_[c], b, Pass::Fprop, today);
        probe(convs_[c], b, Pass::Wgrad, step_ms[{int(Kind::ConvWgrad), int(c)}]);
      }
    }
  }
  return list;
}

}  // namespace rung
