// Which engine runs each convolution pass: cuDNN's heuristic and fallback lists timed, fused against unfused, or the
// engine table's choice rebuilt; and the planner that asks the table first.
#include <algorithm>
#include <iterator>

#include "checks.h"
#include "conv.h"
#include "conv_graph.h"
#include "engine_table.h"
#include "gpu_timing.h"

namespace rung {
namespace {

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

}  // namespace rung
