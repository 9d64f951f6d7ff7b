#include "conv.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <sstream>

#include "kernels.h"
#include "train_kernels.h"

namespace rung {
namespace {

void check(cudnnStatus_t s, const std::string& what) {
  if (s != CUDNN_STATUS_SUCCESS) throw std::runtime_error(what + ": " + cudnn_status(s));
}

// Unique ids of the graph's tensors; the variant pack maps the real ones to device pointers.
enum Uid : int64_t { kX = 1, kW, kBias, kZ, kY, kSum, kSqSum, kVirtual = 100 };

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

// The operation graph of the spec, with the epilogue (fused) or without it. Returns every descriptor it made; the
// operation graph is the last. Tensors are allocated by index up front so that references stay valid.
std::vector<Desc> build_graph(cudnnHandle_t handle, const ConvSpec& spec, bool fused) {
  const ConvShape& s = spec.shape;
  const cudnnDataType_t data = spec.precision->cudnn;
  std::vector<Desc> keep;
  keep.reserve(32);
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
  ops.reserve(8);
  const Desc& conv_out = steps.empty() ? out : find(kVirtual);
  ops.push_back(conv_operation(spec.pass, conv, on_x ? conv_out : x, w, on_x ? y : conv_out));
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

// Engine configurations for the graph, best first by cuDNN's heuristic `mode`.
std::vector<Desc> engine_configs(const Desc& graph, cudnnBackendHeurMode_t mode) {
  Desc heur(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
  heur.set(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph)
      .set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode)
      .finalize();
  int64_t n = 0;
  check(cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &n,
                                 nullptr),
        "engine heuristics count");
  std::vector<Desc> cfgs;
  std::vector<cudnnBackendDescriptor_t> raw;
  for (int64_t i = 0; i < n; ++i) {
    cfgs.emplace_back(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR);
    raw.push_back(cfgs.back().get());
  }
  int64_t got = 0;
  check(cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, n, &got,
                                 raw.data()),
        "engine heuristics results");
  cfgs.erase(cfgs.begin() + got, cfgs.end());
  return cfgs;
}

struct EngineInfo {
  int64_t index = -1;
  std::vector<cudnnBackendNumericalNote_t> numerical;
  std::vector<cudnnBackendBehaviorNote_t> behavior;
  bool has(cudnnBackendNumericalNote_t n) const { return std::find(numerical.begin(), numerical.end(), n) != numerical.end(); }
  bool has(cudnnBackendBehaviorNote_t n) const { return std::find(behavior.begin(), behavior.end(), n) != behavior.end(); }
};

EngineInfo engine_info(const Desc& cfg) {
  Desc engine(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
  cudnnBackendDescriptor_t raw = engine.get();
  int64_t n = 0;
  check(cudnnBackendGetAttribute(cfg.get(), CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n, &raw),
        "engine of config");
  EngineInfo info;
  check(cudnnBackendGetAttribute(raw, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &n, &info.index),
        "engine index");
  info.numerical.resize(CUDNN_NUMERICAL_NOTE_TYPE_COUNT);
  check(cudnnBackendGetAttribute(raw, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, CUDNN_TYPE_NUMERICAL_NOTE,
                                 CUDNN_NUMERICAL_NOTE_TYPE_COUNT, &n, info.numerical.data()),
        "engine numerical notes");
  info.numerical.resize(n);
  info.behavior.resize(CUDNN_BEHAVIOR_NOTE_TYPE_COUNT);
  check(cudnnBackendGetAttribute(raw, CUDNN_ATTR_ENGINE_BEHAVIOR_NOTE, CUDNN_TYPE_BEHAVIOR_NOTE,
                                 CUDNN_BEHAVIOR_NOTE_TYPE_COUNT, &n, info.behavior.data()),
        "engine behaviour notes");
  info.behavior.resize(n);
  return info;
}

// What the plan's stats say of its engine.
void describe(ConvPlan& plan, const EngineInfo& e) {
  plan.engine = e.index;
  plan.tensor_core = e.has(CUDNN_NUMERICAL_NOTE_TENSOR_CORE);
  plan.runtime_compiled = e.has(CUDNN_BEHAVIOR_NOTE_RUNTIME_COMPILATION);
  const bool winograd = e.has(CUDNN_NUMERICAL_NOTE_WINOGRAD) || e.has(CUDNN_NUMERICAL_NOTE_WINOGRAD_TILE_4x4) ||
                        e.has(CUDNN_NUMERICAL_NOTE_WINOGRAD_TILE_6x6) || e.has(CUDNN_NUMERICAL_NOTE_WINOGRAD_TILE_13x13);
  plan.algorithm = winograd ? "winograd" : e.has(CUDNN_NUMERICAL_NOTE_FFT) ? "fft" : "direct";
}

// The dtype contract, as PyTorch applies it to cuDNN engines: never inputs down-converted or reductions in reduced
// precision (accumulation stays fp32), and no tensor cores (TF32) for strict fp32.
bool allowed(const EngineInfo& e, const Precision& p) {
  if (e.has(CUDNN_NUMERICAL_NOTE_DOWN_CONVERT_INPUTS) || e.has(CUDNN_NUMERICAL_NOTE_REDUCED_PRECISION_REDUCTION))
    return false;
  return !(p.storage == Storage::F32 && !p.tf32 && e.has(CUDNN_NUMERICAL_NOTE_TENSOR_CORE));
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
  Desc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
  pack.set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, int64_t(ptrs.size()), ptrs.data())
      .set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, uids)
      .set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace)
      .finalize();
  return pack;
}

// A call longer than this is GPU time: the host's part of one (tens of microseconds) is no part of a ranking.
constexpr double kHostBoundMs = 1.0;
// Under a graph, each replay holds about kReplayMs of calls, at most kReplayCalls: many at batch 1, one where a call
// is long.
constexpr double kReplayMs = 0.2;
constexpr int kReplayCalls = 20;
int replay_calls(double call_ms) {  // (a zero reading takes the most, not a division by zero)
  return call_ms * kReplayCalls > kReplayMs ? std::max(1, int(kReplayMs / call_ms)) : kReplayCalls;
}

// The heuristic lists searched, by the index an engine table records (0 and 1 first: tables written before mode B
// was searched stay valid).
constexpr cudnnBackendHeurMode_t kHeurModes[] = {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK, CUDNN_HEUR_MODE_B};

// Times up to `candidates` allowed engine configurations of the graph from each list, the heuristics' (modes A
// and B) and cuDNN's fallback list, and keeps the fastest; unfused, the time includes our epilogue kernel. Several
// lists: for strict fp32 (no tensor cores) mode A's few allowed engines can be 100x slower than a fallback one (a
// 1x1 data gradient ran at 0.4 TFLOP/s), and mode B ranks engines by a slower, more accurate model. An engine two
// lists share is timed once. Throws with the reasons if none runs.
std::shared_ptr<ConvPlan> tune_graph(cudnnHandle_t handle, const ConvSpec& spec, bool fused, const ConvIO& io,
                                     TuningWorkspace& ws, const EngineSearch& search, cudaStream_t stream) {
  auto best = std::make_shared<ConvPlan>();
  best->keep = build_graph(handle, spec, fused);
  best->fused = fused;
  const Desc& graph = best->keep.back();
  std::unique_ptr<Desc> best_cfg;
  std::string errors;
  int listed = 0, allowed_n = 0, finalized_ok = 0;  // for the message when nothing runs
  std::vector<int64_t> seen;  // engines already listed by an earlier list
  for (int mode_i = 0; mode_i < int(std::size(kHeurModes)); ++mode_i) {
    const cudnnBackendHeurMode_t mode = kHeurModes[mode_i];
    int finalized = 0;  // runtime-compiled engines compile in finalize: bound the attempts, not only the successes
    int timed = 0;
    std::vector<Desc> cfgs;
    try {
      cfgs = engine_configs(graph, mode);
    } catch (const std::exception& e) {  // no engine of this heuristic mode supports the graph
      errors += std::string(errors.empty() ? "" : "; ") + e.what();
      continue;
    }
    listed += int(cfgs.size());
    for (size_t pos = 0; pos < cfgs.size(); ++pos) {
      Desc& cfg = cfgs[pos];
      if (timed >= search.candidates) break;
      EngineInfo info = engine_info(cfg);
      if (!allowed(info, *spec.precision)) continue;
      // Mode B mostly reorders mode A's list: skip an engine mode A or the fallback list already timed.
      if (mode == CUDNN_HEUR_MODE_B && std::find(seen.begin(), seen.end(), info.index) != seen.end()) continue;
      seen.push_back(info.index);
      ++allowed_n;
      if (++finalized > 4 * search.candidates) break;
      auto plan = std::make_unique<Desc>(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
      plan->set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle)
          .set(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, cfg);
      if (cudnnBackendFinalize(plan->get()) != CUDNN_STATUS_SUCCESS) continue;  // config not valid here
      ++finalized_ok;
      int64_t need = 0, n = 0;
      check(cudnnBackendGetAttribute(plan->get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &n,
                                     &need),
            "plan workspace size");
      if (size_t(need) > ws.limit()) continue;
      Desc pack = variant_pack(spec, fused, io, ws.ensure(size_t(need)));
      if (cudnnBackendExecute(handle, plan->get(), pack.get()) != CUDNN_STATUS_SUCCESS) continue;
      auto call = [&] {
        before_graph(spec, fused, io, stream);
        CUDNN_CHECK(cudnnBackendExecute(handle, plan->get(), pack.get()));
        after_graph(spec, fused, io, stream);
      };
      // One call first: an engine already 2x slower than the best, and slow enough that the host's time is no part
      // of it, is not timed further (strict fp32 lists engines that take 100 ms a call; timing each five times made
      // the build minutes long).
      double ms = median_ms(stream, call, 1, 0);
      if (!best->plan || ms < 2 * best->tuned_ms || ms <= kHostBoundMs) {
        ms = search.graph ? graph_ms(stream, call, replay_calls(ms), 5) : median_ms(stream, call, 5, 0);
        if (ms < 0) continue;  // not capturable: no use to a captured network
      }
      ++best->tried;
      ++timed;
      if (best->plan && ms >= best->tuned_ms) continue;
      best->plan = std::move(plan);
      best_cfg = std::make_unique<Desc>(std::move(cfg));
      best->tuned_ms = ms;
      best->heur_mode = mode_i;
      best->heur_index = int(pos);
      best->workspace = need;
      describe(*best, info);
    }
  }
  if (!best->plan)
    throw std::runtime_error(std::to_string(listed) + " engine configs listed, " + std::to_string(allowed_n) +
                             " allowed for the dtype, " + std::to_string(finalized_ok) + " finalized, none ran" +
                             (errors.empty() ? "" : "; " + errors));
  best->keep.push_back(std::move(*best_cfg));
  return best;
}

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

}  // namespace

std::shared_ptr<ConvPlan> plan_from_choice(cudnnHandle_t handle, const ConvSpec& spec, const ConvIO& io,
                                           TuningWorkspace& ws, const EngineChoice& choice) {
  auto out = std::make_shared<ConvPlan>();
  out->keep = build_graph(handle, spec, choice.fused);
  out->fused = choice.fused;
  std::vector<Desc> cfgs;
  try {
    if (choice.heur_mode < 0 || choice.heur_mode >= int(std::size(kHeurModes))) return nullptr;
    cfgs = engine_configs(out->keep.back(), kHeurModes[choice.heur_mode]);
  } catch (const std::exception&) {
    return nullptr;
  }
  if (choice.heur_index < 0 || size_t(choice.heur_index) >= cfgs.size()) return nullptr;
  Desc& cfg = cfgs[choice.heur_index];
  EngineInfo info = engine_info(cfg);
  if (!allowed(info, *spec.precision)) return nullptr;
  out->plan = std::make_unique<Desc>(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
  out->plan->set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle)
      .set(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, cfg);
  if (cudnnBackendFinalize(out->plan->get()) != CUDNN_STATUS_SUCCESS) return nullptr;
  int64_t need = 0, n = 0;
  check(cudnnBackendGetAttribute(out->plan->get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &n,
                                 &need),
        "plan workspace size");
  if (size_t(need) > ws.limit()) return nullptr;
  Desc pack = variant_pack(spec, choice.fused, io, ws.ensure(size_t(need)));
  if (cudnnBackendExecute(handle, out->plan->get(), pack.get()) != CUDNN_STATUS_SUCCESS) return nullptr;
  out->workspace = need;
  describe(*out, info);
  out->heur_mode = choice.heur_mode;
  out->heur_index = choice.heur_index;
  out->tuned_ms = -1;
  if (!choice.fused) out->unfused_reason = "engine table";
  out->keep.push_back(std::move(cfg));
  return out;
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
  return shape.str() + " " + epilogue_name(epilogue) + (pass == Pass::Fprop ? "" : std::string(" ") + pass_name(pass));
}

std::string ConvShape::str() const {
  char buf[128];
  std::snprintf(buf, sizeof buf, "n%d c%d %dx%d -> k%d %dx%d/s%d p%d", n, c, h, w, k, r, s, stride, pad);
  return buf;
}

ladder::Json ConvPlan::stats() const {
  ladder::Json j = ladder::Json::object();
  j["fused"] = fused;
  if (!fused) j["unfused_reason"] = unfused_reason;
  j["engine"] = static_cast<long long>(engine);
  j["tensor_core"] = tensor_core;
  j["runtime_compiled"] = runtime_compiled;
  j["algorithm"] = algorithm;
  j["workspace_bytes"] = static_cast<long long>(workspace);
  j["candidates_timed"] = tried;
  j["choice"] = tried ? "tuned" : "engine table";
  j["tuned_ms"] = tuned_ms >= 0 ? ladder::Json(tuned_ms) : ladder::Json();
  j["fused_ms"] = fused_ms >= 0 ? ladder::Json(fused_ms) : ladder::Json();  // null: no engine for that variant
  j["unfused_ms"] = unfused_ms >= 0 ? ladder::Json(unfused_ms) : ladder::Json();
  return j;
}

std::shared_ptr<ConvPlan> tune_conv(cudnnHandle_t handle, const ConvSpec& spec, const ConvIO& io,
                                    TuningWorkspace& ws, const EngineSearch& search, cudaStream_t stream) {
  // Both ways, timed: a fused engine can be slower than the best plain convolution plus our epilogue kernel
  // (strict fp32 has few fusing engines), and some graphs have no fusing engine at all.
  std::shared_ptr<ConvPlan> fused, alone;
  std::string why = "no epilogue";
  if (spec.epilogue == Epilogue::Stats && spec.precision->storage == Storage::F32) {
    // fp32 is held to eager fp32 within fp32's own precision: genstats' sum of squares in fp32 loses a channel's
    // variance where its mean is large against its spread, where per-thread Welford does not.
    why = "fp32 keeps our Welford statistics";
  } else if (spec.epilogue != Epilogue::None) {
    try {
      fused = tune_graph(handle, spec, true, io, ws, search, stream);
    } catch (const std::exception& e) {
      why = e.what();
    }
  }
  try {
    alone = tune_graph(handle, spec, false, io, ws, search, stream);
  } catch (const std::exception& e) {
    if (!fused)
      throw std::runtime_error(std::string("no cuDNN engine runs ") + pass_name(spec.pass) + " of conv " +
                               spec.shape.str() + " in " + spec.precision->name + ": " + e.what());
  }
  const double fused_ms = fused ? fused->tuned_ms : -1, alone_ms = alone ? alone->tuned_ms : -1;
  auto chosen = fused && (!alone || fused_ms <= alone_ms) ? fused : alone;
  if (!chosen->fused) chosen->unfused_reason = fused ? "faster unfused" : why;
  chosen->fused_ms = fused_ms;
  chosen->unfused_ms = alone_ms;
  return chosen;
}

ConvPlanner::ConvPlanner(cudnnHandle_t handle, EngineOptions o, cudaStream_t stream)
    : handle_(handle), o_(std::move(o)), stream_(stream), scratch_(o_.workspace_limit),
      prefix_("cudnn" + std::to_string(cudnnGetVersion()) + " " + o_.precision->name + (o_.nhwc ? " nhwc " : " nchw ") +
              (o_.search.graph ? "graph " : "")),
      table_(read_engine_tables(o_.tables)) {}

std::shared_ptr<ConvPlan> ConvPlanner::plan(const ConvSpec& spec, const ConvIO& io) {
  const std::string key = spec.key();
  auto& plan = tuned_[key];
  auto known = table_.find(prefix_ + key);
  if (!plan && known != table_.end()) {
    plan = plan_from_choice(handle_, spec, io, scratch_, known->second);
    from_table_ += bool(plan);
  }
  if (!plan) {
    plan = tune_conv(handle_, spec, io, scratch_, o_.search, stream_);
    append_engine_choice(o_.table_out, prefix_ + key, {plan->fused, plan->heur_mode, plan->heur_index});
  }
  workspace_ = std::max(workspace_, size_t(plan->workspace));
  return plan;
}

void ConvPlanner::report(ladder::Json& stats) const {
  stats["distinct_conv_plans"] = int(tuned_.size());
  stats["conv_plans_from_engine_tables"] = from_table_;
  ladder::Json tables = ladder::Json::array();
  for (const std::string& t : o_.tables) tables.push_back(t);
  stats["engine_tables"] = tables;
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
