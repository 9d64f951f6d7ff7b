// Building a convolution pass's cuDNN graph (backend API), the descriptors it is made of, and one layer's run.
#include "conv_graph.h"

#include <cstdio>

#include "checks.h"
#include "inference_kernels.h"
#include "training_kernels.h"

namespace rung {
namespace {

// Unique ids of the graph's tensors; the variant pack maps the real ones to device pointers.
enum Uid : int64_t { kX = 1, kW, kBias, kZ, kY, kSum, kSqSum, kScale, kShift, kVirtual = 100, kPrologue = 200 };

// dims are [N, C, H, W] (filters [K, C, R, S]); NHWC keeps C innermost.
std::vector<int64_t> strides_for(const std::vector<int64_t>& d, bool nhwc) {
  if (nhwc) return {d[1] * d[2] * d[3], 1, d[3] * d[1], d[1]};
  return {d[1] * d[2] * d[3], d[2] * d[3], d[3], 1};
}

Desc tensor(int64_t uid, const std::vector<int64_t>& dims, bool nhwc, cudnnDataType_t type, bool is_virtual) {
  Desc t(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
  int64_t alignment = 16;
  t.set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type)
      .set(CUDNN_ATTR_TENSOR_DIMENSIONS, dims)
      .set(CUDNN_ATTR_TENSOR_STRIDES, strides_for(dims, nhwc))
      .set(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid)
      .set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment)
      .set(CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &is_virtual)
      .finalize();
  return t;
}

// One pointwise node y = mode(x[, b]) computed in fp32; its mode descriptor goes to `keep`.
Desc pointwise(cudnnPointwiseMode_t mode, const Desc& x, const Desc* b, const Desc& y, std::vector<Desc>& keep) {
  Desc pw(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
  cudnnDataType_t math = CUDNN_DATA_FLOAT;
  pw.set(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode)
      .set(CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &math)
      .finalize();
  Desc op(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
  op.set(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pw).set(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x);
  if (b) op.set(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, *b);
  op.set(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y).finalize();
  keep.push_back(std::move(pw));
  return op;
}

// BatchNorm's statistics of y, per channel: sum and sum of squares in fp32 (cuDNN's genstats).
Desc genstats(const Desc& y, const Desc& sum, const Desc& sqsum) {
  cudnnGenStatsMode_t mode = CUDNN_GENSTATS_SUM_SQSUM;
  cudnnDataType_t math = CUDNN_DATA_FLOAT;
  Desc op(CUDNN_BACKEND_OPERATION_GEN_STATS_DESCRIPTOR);
  op.set(CUDNN_ATTR_OPERATION_GENSTATS_MODE, CUDNN_TYPE_GENSTATS_MODE, 1, &mode)
      .set(CUDNN_ATTR_OPERATION_GENSTATS_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &math)
      .set(CUDNN_ATTR_OPERATION_GENSTATS_XDESC, y)
      .set(CUDNN_ATTR_OPERATION_GENSTATS_SUMDESC, sum)
      .set(CUDNN_ATTR_OPERATION_GENSTATS_SQSUMDESC, sqsum)
      .finalize();
  return op;
}

bool bias(Epilogue e) { return e == Epilogue::Bias || e == Epilogue::BiasRelu || e == Epilogue::BiasAddRelu; }
bool adds(Epilogue e) { return e == Epilogue::BiasAddRelu || e == Epilogue::Add; }
bool relu(Epilogue e) { return e == Epilogue::BiasRelu || e == Epilogue::BiasAddRelu; }

// The convolution node of a pass over the forward's tensors x, w and y (the pass writes dx, dw or y): the three
// operations differ only in their descriptor type and attribute names.
Desc conv_operation(Pass pass, const Desc& conv, const Desc& x, const Desc& w, const Desc& y) {
  struct Names {
    cudnnBackendDescriptorType_t type;
    cudnnBackendAttributeName_t alpha, beta, conv, x, w, y;
  };
  static const Names fprop{CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR,
                           CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA,
                           CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA,
                           CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC,
                           CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X,
                           CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W,
                           CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y};
  static const Names dgrad{CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR,
                           CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_ALPHA,
                           CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_BETA,
                           CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_CONV_DESC,
                           CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DX,
                           CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_W,
                           CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DY};
  static const Names wgrad{CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR,
                           CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_ALPHA,
                           CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_BETA,
                           CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_CONV_DESC,
                           CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_X,
                           CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DW,
                           CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DY};
  const Names& n = pass == Pass::Fprop ? fprop : pass == Pass::Dgrad ? dgrad : wgrad;
  const float alpha = 1.f, beta = 0.f;
  Desc op(n.type);
  op.set(n.alpha, CUDNN_TYPE_FLOAT, 1, &alpha)
      .set(n.beta, CUDNN_TYPE_FLOAT, 1, &beta)
      .set(n.conv, conv)
      .set(n.x, x)
      .set(n.w, w)
      .set(n.y, y)
      .finalize();
  return op;
}

}  // namespace

void check(cudnnStatus_t s, const std::string& what) {
  if (s != CUDNN_STATUS_SUCCESS) throw std::runtime_error(what + ": " + cudnn_status(s));
}

// The operation graph of the spec, with the epilogue (fused) or without it. Returns every descriptor it made; the
// operation graph is the last. Tensors are allocated by index up front so that references stay valid.
std::vector<Desc> build_graph(cudnnHandle_t handle, const ConvSpec& spec, bool fused) {
  const ConvShape& s = spec.shape;
  const cudnnDataType_t data = spec.precision->cudnn;
  std::vector<Desc> keep;
  keep.reserve(48);
  keep.push_back(tensor(kX, {s.n, s.c, s.h, s.w}, spec.nhwc, data, false));
  keep.push_back(tensor(kW, {s.k, s.c, s.r, s.s}, spec.nhwc, data, false));
  keep.push_back(tensor(kY, {s.n, s.k, s.p(), s.q()}, spec.nhwc, data, false));
  const Desc &x = keep[0], &w = keep[1], &y = keep[2];

  Desc conv(CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR);
  cudnnDataType_t accumulate = CUDNN_DATA_FLOAT;
  cudnnConvolutionMode_t mode = CUDNN_CROSS_CORRELATION;  // what PyTorch's conv2d computes
  int64_t dims = 2;
  conv.set(CUDNN_ATTR_CONVOLUTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &accumulate)
      .set(CUDNN_ATTR_CONVOLUTION_CONV_MODE, CUDNN_TYPE_CONVOLUTION_MODE, 1, &mode)
      .set(CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, CUDNN_TYPE_INT64, 1, &dims)
      .set(CUDNN_ATTR_CONVOLUTION_DILATIONS, std::vector<int64_t>{1, 1})
      .set(CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES, std::vector<int64_t>{s.stride, s.stride})
      .set(CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, std::vector<int64_t>{s.pad, s.pad})
      .set(CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, std::vector<int64_t>{s.pad, s.pad})
      .finalize();

  // The chain after the convolution: each step reads the previous result; the last one writes the pass's output
  // (y; dx for the data gradient).
  struct Step { cudnnPointwiseMode_t mode; int64_t operand; };
  std::vector<Step> steps;
  const bool stats = fused && spec.epilogue == Epilogue::Stats;  // y itself is written; genstats reads it
  if (fused && bias(spec.epilogue)) steps.push_back({CUDNN_POINTWISE_ADD, kBias});
  if (fused && adds(spec.epilogue)) steps.push_back({CUDNN_POINTWISE_ADD, kZ});
  if (fused && relu(spec.epilogue)) steps.push_back({CUDNN_POINTWISE_RELU_FWD, 0});
  const bool on_x = spec.pass == Pass::Dgrad;
  const Desc& out = on_x ? x : y;
  const std::vector<int64_t> out_dims = on_x ? std::vector<int64_t>{s.n, s.c, s.h, s.w}
                                             : std::vector<int64_t>{s.n, s.k, s.p(), s.q()};
  // fp32 intermediates between the fused nodes: one rounding to the storage type, at the end.
  const size_t first_virtual = keep.size();
  for (size_t i = 0; i < steps.size(); ++i)
    keep.push_back(tensor(kVirtual + int64_t(i), out_dims, spec.nhwc, CUDNN_DATA_FLOAT, true));
  const size_t bias_at = keep.size();
  if (fused && bias(spec.epilogue)) keep.push_back(tensor(kBias, {1, s.k, 1, 1}, spec.nhwc, data, false));
  const size_t z_at = keep.size();
  if (fused && adds(spec.epilogue)) keep.push_back(tensor(kZ, out_dims, spec.nhwc, data, false));
  auto find = [&](int64_t uid) -> const Desc& {
    if (uid == kBias) return keep[bias_at];
    if (uid == kZ) return keep[z_at];
    return keep[first_virtual + (uid - kVirtual)];  // virtual outputs
  };

  std::vector<Desc> ops;
  ops.reserve(12);
  const Desc* conv_x = &x;  // what the convolution reads as x: x itself, or the prologue's relu(x * scale + shift)
  if (spec.prologue != Prologue::None) {
    if (on_x) throw std::runtime_error("a prologue normalises x, which the data gradient writes");
    const std::vector<int64_t> x_dims{s.n, s.c, s.h, s.w}, channel{1, s.c, 1, 1};
    const cudnnDataType_t operands = spec.prologue == Prologue::ScaleShiftReluF32 ? CUDNN_DATA_FLOAT : data;
    const size_t at = keep.size();
    keep.push_back(tensor(kScale, channel, spec.nhwc, operands, false));
    keep.push_back(tensor(kShift, channel, spec.nhwc, operands, false));
    for (int64_t i = 0; i < 3; ++i) keep.push_back(tensor(kPrologue + i, x_dims, spec.nhwc, CUDNN_DATA_FLOAT, true));
    ops.push_back(pointwise(CUDNN_POINTWISE_MUL, x, &keep[at], keep[at + 2], keep));
    ops.push_back(pointwise(CUDNN_POINTWISE_ADD, keep[at + 2], &keep[at + 1], keep[at + 3], keep));
    ops.push_back(pointwise(CUDNN_POINTWISE_RELU_FWD, keep[at + 3], nullptr, keep[at + 4], keep));
    conv_x = &keep[at + 4];
  }
  const Desc& conv_out = steps.empty() ? out : find(kVirtual);
  ops.push_back(conv_operation(spec.pass, conv, on_x ? conv_out : *conv_x, w, on_x ? y : conv_out));
  for (size_t i = 0; i < steps.size(); ++i) {
    const Desc& in = find(kVirtual + int64_t(i));
    const Desc& to = i + 1 == steps.size() ? out : find(kVirtual + int64_t(i) + 1);
    const Desc* operand = steps[i].operand ? &find(steps[i].operand) : nullptr;
    ops.push_back(pointwise(steps[i].mode, in, operand, to, keep));
  }
  if (stats) {
    keep.push_back(tensor(kSum, {1, s.k, 1, 1}, spec.nhwc, CUDNN_DATA_FLOAT, false));
    keep.push_back(tensor(kSqSum, {1, s.k, 1, 1}, spec.nhwc, CUDNN_DATA_FLOAT, false));
    ops.push_back(genstats(y, keep[keep.size() - 2], keep.back()));
  }

  Desc graph(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
  std::vector<cudnnBackendDescriptor_t> raw;
  for (auto& op : ops) raw.push_back(op.get());
  graph.set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle)
      .set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, int64_t(raw.size()), raw.data())
      .finalize();
  keep.push_back(std::move(conv));
  for (auto& op : ops) keep.push_back(std::move(op));
  keep.push_back(std::move(graph));
  return keep;
}

// Before the graph: genstats' sums zeroed (whether an engine accumulates into them or overwrites them is not
// documented).
void before_graph(const ConvSpec& spec, bool fused, const ConvIO& io, cudaStream_t stream) {
  if (fused && spec.epilogue == Epilogue::Stats)
    LADDER_CUDA(cudaMemsetAsync(io.stats, 0, 2 * sizeof(float) * spec.shape.k, stream));
}

// After a convolution run alone, the epilogue by our kernel: in place on y, or the statistics of y.
void after_graph(const ConvSpec& spec, bool fused, const ConvIO& io, cudaStream_t stream) {
  if (fused || spec.epilogue == Epilogue::None) return;
  const ConvShape& s = spec.shape;
  const size_t plane = size_t(s.p()) * s.q();
  if (spec.epilogue == Epilogue::Stats) {
    bn_statistics(io.y, spec.precision->storage, int64_t(s.n) * plane, s.k, io.stats, stream);
    return;
  }
  if (spec.epilogue == Epilogue::Add) {  // the data gradient's: dx += z
    void* dx = const_cast<void*>(io.x);
    add(dx, io.z, dx, spec.precision->storage, size_t(s.n) * s.c * s.h * s.w, stream);
    return;
  }
  bias_add_relu(io.y, io.bias, adds(spec.epilogue) ? io.z : nullptr, relu(spec.epilogue),
                spec.precision->storage, size_t(s.n) * s.k * plane, s.k, spec.nhwc ? 1 : plane, stream);
}

Desc variant_pack(const ConvSpec& spec, bool fused, const ConvIO& io, void* workspace) {
  std::vector<int64_t> uids = {kX, kW, kY};
  std::vector<void*> ptrs = {const_cast<void*>(io.x), const_cast<void*>(io.w), io.y};
  if (fused && bias(spec.epilogue)) {
    uids.push_back(kBias);
    ptrs.push_back(const_cast<void*>(io.bias));
  }
  if (fused && adds(spec.epilogue)) {
    uids.push_back(kZ);
    ptrs.push_back(const_cast<void*>(io.z));
  }
  if (fused && spec.epilogue == Epilogue::Stats) {
    uids.insert(uids.end(), {kSum, kSqSum});
    ptrs.insert(ptrs.end(), {io.stats, io.stats + spec.shape.k});
  }
  if (spec.prologue != Prologue::None) {
    const size_t operand = spec.prologue == Prologue::ScaleShiftReluF32 ? sizeof(float) : spec.precision->bytes;
    char* scale = static_cast<char*>(const_cast<void*>(io.scale_shift));
    uids.insert(uids.end(), {kScale, kShift});
    ptrs.insert(ptrs.end(), {scale, scale + operand * spec.shape.c});
  }
  Desc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
  pack.set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, int64_t(ptrs.size()), ptrs.data())
      .set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, uids)
      .set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace)
      .finalize();
  return pack;
}

Desc::Desc(cudnnBackendDescriptorType_t type) {
  check(cudnnBackendCreateDescriptor(type, &d_), "create backend descriptor " + std::to_string(int(type)));
}

Desc::~Desc() {
  if (d_) cudnnBackendDestroyDescriptor(d_);
}

Desc& Desc::set(cudnnBackendAttributeName_t attr, cudnnBackendAttributeType_t type, int64_t count, const void* values) {
  check(cudnnBackendSetAttribute(d_, attr, type, count, values), "set backend attribute " + std::to_string(int(attr)));
  return *this;
}

Desc& Desc::set(cudnnBackendAttributeName_t attr, const Desc& d) {
  cudnnBackendDescriptor_t raw = d.get();
  return set(attr, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &raw);
}

Desc& Desc::set(cudnnBackendAttributeName_t attr, const std::vector<int64_t>& v) {
  return set(attr, CUDNN_TYPE_INT64, int64_t(v.size()), v.data());
}

Desc& Desc::finalize() {
  check(cudnnBackendFinalize(d_), "finalize backend descriptor");
  return *this;
}

const char* epilogue_name(Epilogue e) {
  switch (e) {
    case Epilogue::None: return "none";
    case Epilogue::Bias: return "bias";
    case Epilogue::BiasRelu: return "bias+relu";
    case Epilogue::BiasAddRelu: return "bias+add+relu";
    case Epilogue::Stats: return "stats";
    case Epilogue::Add: return "add";
  }
  return "?";
}

const char* prologue_name(Prologue p) {
  switch (p) {
    case Prologue::None: return "none";
    case Prologue::ScaleShiftReluF32: return "scale+shift+relu(fp32)";
    case Prologue::ScaleShiftRelu: return "scale+shift+relu";
  }
  return "?";
}

const char* pass_name(Pass p) {
  switch (p) {
    case Pass::Fprop: return "fprop";
    case Pass::Dgrad: return "dgrad";
    case Pass::Wgrad: return "wgrad";
  }
  return "?";
}

std::string ConvSpec::key() const {
  // Inference keys predate the passes: a forward's key names no pass, so shipped engine tables stay valid.
  return shape.str() + " " + epilogue_name(epilogue) + (pass == Pass::Fprop ? "" : std::string(" ") + pass_name(pass)) +
         (prologue == Prologue::None ? "" : std::string(" prologue ") + prologue_name(prologue));
}

std::string ConvShape::str() const {
  char buf[128];
  std::snprintf(buf, sizeof buf, "n%d c%d %dx%d -> k%d %dx%d/s%d p%d", n, c, h, w, k, r, s, stride, pad);
  return buf;
}

void ConvLayer::bind(void* workspace) {
  pack_ = std::make_unique<Desc>(variant_pack(spec_, plan_->fused, io_, workspace));
}

void ConvLayer::run(cudnnHandle_t handle, cudaStream_t stream) const {
  before_graph(spec_, plan_->fused, io_, stream);
  CUDNN_CHECK(cudnnBackendExecute(handle, plan_->plan->get(), pack_->get()));
  after_graph(spec_, plan_->fused, io_, stream);
}

}  // namespace rung
