// A convolution with its epilogue as one cuDNN graph (backend API):
//   conv -> [+ bias] [-> + residual] [-> relu],  or  conv -> y, genstats(y) (training: BatchNorm's statistics),
// with fp32 virtual intermediates, run by the engine configuration that measured fastest among cuDNN's heuristic
// candidates; or the convolution alone followed by our kernel (bias_add_relu(), bn_statistics(), add()), where that
// measured faster or nothing fuses. Training uses the same machinery in each of the convolution's three passes
// (forward, data gradient, weight gradient).
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <cudnn.h>

#include "device_memory.h"
#include "precision.h"

namespace rung {

// RAII for a backend descriptor; every status is checked and names the attribute.
class Desc {
 public:
  explicit Desc(cudnnBackendDescriptorType_t type);
  ~Desc();
  Desc(Desc&& o) noexcept : d_(o.d_) { o.d_ = nullptr; }
  Desc(const Desc&) = delete;
  Desc& operator=(const Desc&) = delete;
  Desc& operator=(Desc&& o) noexcept {
    std::swap(d_, o.d_);
    return *this;
  }
  cudnnBackendDescriptor_t get() const { return d_; }
  Desc& set(cudnnBackendAttributeName_t attr, cudnnBackendAttributeType_t type, int64_t count, const void* values);
  Desc& set(cudnnBackendAttributeName_t attr, const Desc& d);
  Desc& set(cudnnBackendAttributeName_t attr, const std::vector<int64_t>& v);
  Desc& finalize();

 private:
  cudnnBackendDescriptor_t d_ = nullptr;
};

// Inference: projection skip, inner convs, block output. Training's forward: Stats, y and its per-channel statistics
// for the BatchNorm in training mode that follows; a block's first data gradient: Add, dx plus the gradient of the
// block's other branch (the residual's sum); other backward passes: None.
enum class Epilogue { None, Bias, BiasRelu, BiasAddRelu, Stats, Add };
const char* epilogue_name(Epilogue e);

// Which of the convolution's three computations the graph is: y = conv(x, w), dx = dgrad(dy, w), dw = wgrad(x, dy).
enum class Pass { Fprop, Dgrad, Wgrad };
const char* pass_name(Pass p);

// The pass's x taken through a BatchNorm's apply and ReLU on the fly, relu(x * scale + shift) per input channel
// (MLPerf's norm-conv: the normalised activation is never written; the weight gradient recomputes it), inside the
// cuDNN graph whether the epilogue is fused or not; Fprop and Wgrad only. Scale and shift in fp32, or in the storage
// type (as cuDNN's samples give them).
enum class Prologue { None, ScaleShiftReluF32, ScaleShiftRelu };
const char* prologue_name(Prologue p);

struct ConvShape {
  int n, c, h, w;           // input (c includes any zero padding of the stem's channels)
  int k, r, s, stride, pad;
  int p() const { return (h + 2 * pad - r) / stride + 1; }
  int q() const { return (w + 2 * pad - s) / stride + 1; }
  double flops() const { return 2.0 * n * k * p() * q() * double(c) * r * s; }
  std::string str() const;  // e.g. "n32 c64 56x56 -> k256 1x1/s1 p0"
};

// The tensors of a pass, named as in the forward: Dgrad writes x (dx) from y (dy) and w; Wgrad writes w (dw) from
// x and y (dy).
struct ConvIO {
  const void* x;
  const void* w;     // KRSC (NHWC) or KCRS (NCHW); inference: BN folded in
  const void* bias;  // [k], BN folded in; only with a bias epilogue
  const void* z;     // added to the pass's output (y, or dx), same shape; only for Epilogue::BiasAddRelu and Add
  void* y;
  // Epilogue::Stats: fused, cuDNN's per-channel sum then sum of squares of y ([2][k] fp32); unfused,
  // bn_statistics()'s partial sums (training_kernels.h)
  float* stats = nullptr;
  const void* scale_shift = nullptr;  // a Prologue's [2][c]: scale, then shift, in the prologue's type
};

// The tuned, pointer-free part: shared by every layer of the same shape and epilogue.
struct ConvPlan {
  std::vector<Desc> keep;      // graph, tensors and engine config, alive as long as the plan
  std::unique_ptr<Desc> plan;  // finalized execution plan
  bool fused = false;          // epilogue inside the cuDNN graph
  std::string unfused_reason;  // why not, when not: no fusing engine, or slower
  int64_t engine = -1;         // global engine index
  bool tensor_core = false, runtime_compiled = false;
  // From the engine's numerical notes: "winograd" or "fft" multiply less than a direct convolution does, so a
  // roofline counting the direct convolution's FLOPs does not bound them; "direct" otherwise (implicit GEMM)
  std::string algorithm = "direct";
  int64_t workspace = 0;
  int tried = 0;               // candidates timed (0: the choice came from an engine table)
  int heur_mode = 0, heur_index = -1;  // where the choice sits: heuristic list (0 mode A, 1 fallback, 2 mode B), position in it
  double tuned_ms = 0;         // its median time while tuning (unfused: with our epilogue kernel; under a graph: GPU
                               // time a call in graph replays); -1 from a table
  double fused_ms = -1, unfused_ms = -1;  // the best of each variant; -1: no engine runs that variant
  ladder::Json stats() const;
};

struct ConvSpec {
  ConvShape shape;
  Epilogue epilogue;
  const Precision* precision;
  bool nhwc;
  Pass pass = Pass::Fprop;
  Prologue prologue = Prologue::None;
  std::string key() const;  // what an engine choice depends on besides the GPU, dtype and layout
};

// How a convolution's engine configuration is searched.
struct EngineSearch {
  int candidates;  // configurations timed from each heuristic list
  // For a network captured in a CUDA graph: configurations are ranked by their GPU time in graph replays (graph_ms)
  // instead of one call's latency, which counts the host's work before the kernel; their choices are kept apart.
  bool graph;
};

std::shared_ptr<ConvPlan> tune_conv(cudnnHandle_t handle, const ConvSpec& spec, const ConvIO& io,
                                    TuningWorkspace& ws, const EngineSearch& search, cudaStream_t stream);

// An engine choice as an engine table keeps it (one line: key, fused, heuristic mode, position in its list).
struct EngineChoice {
  bool fused;
  int heur_mode, heur_index;
};

// The plan of a remembered choice, untimed; nullptr if it no longer finalizes, runs or fits (then: tune).
std::shared_ptr<ConvPlan> plan_from_choice(cudnnHandle_t handle, const ConvSpec& spec, const ConvIO& io,
                                           TuningWorkspace& ws, const EngineChoice& choice);

// How a network's engines are chosen.
struct EngineOptions {
  const Precision* precision;
  bool nhwc;
  EngineSearch search;
  size_t workspace_limit;  // the most workspace one candidate may ask for
  std::vector<std::string> tables;  // engine choices to reuse (shipped for this GPU, the run's own), read in order
  std::string table_out;            // where choices tuned here are appended ("" = nowhere)
};

// The plans of one network's convolutions: each distinct spec (ConvSpec::key) tuned once, or taken from an engine
// table, and shared by every layer that repeats it.
class ConvPlanner {
 public:
  ConvPlanner(cudnnHandle_t handle, EngineOptions o, cudaStream_t stream);
  std::shared_ptr<ConvPlan> plan(const ConvSpec& spec, const ConvIO& io);
  TuningWorkspace& scratch() { return scratch_; }
  size_t workspace() const { return workspace_; }  // the most any chosen plan needs
  void report(ladder::Json& stats) const;

 private:
  cudnnHandle_t handle_;
  EngineOptions o_;
  cudaStream_t stream_;
  TuningWorkspace scratch_;
  std::string prefix_;  // what a choice depends on besides the GPU model (the table's folder) and the spec
  std::map<std::string, EngineChoice> table_;
  std::map<std::string, std::shared_ptr<ConvPlan>> tuned_;
  int from_table_ = 0;
  size_t workspace_ = 0;
};

// One convolution of the network: a tuned plan bound to its buffers and the shared workspace.
class ConvLayer {
 public:
  ConvLayer(std::string name, ConvSpec spec, ConvIO io, std::shared_ptr<ConvPlan> plan)
      : name_(std::move(name)), spec_(spec), io_(io), plan_(std::move(plan)) {}
  void bind(void* workspace);  // (re)builds the variant pack
  void run(cudnnHandle_t handle, cudaStream_t stream) const;
  const std::string& name() const { return name_; }
  const ConvSpec& spec() const { return spec_; }
  const ConvPlan& plan() const { return *plan_; }

 private:
  std::string name_;
  ConvSpec spec_;
  ConvIO io_;
  std::shared_ptr<ConvPlan> plan_;
  std::unique_ptr<Desc> pack_;
};

}  // namespace rung
