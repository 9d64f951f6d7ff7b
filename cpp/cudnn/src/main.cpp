// The `cudnn` rung: an exact torchvision ResNet-50 from cuDNN, cuBLASLt and a little CUDA of our own, measured by
// the ladder's protocol (cpp/common/ladder/protocol.h): its forward (net.h) or, with --task train, its training step
// (train_net.h). With `--micro 1` it instead times each distinct convolution of the forward, or each step of the
// training schedule, alone and prints them as one line `@@micro [...]` (JSON).
#include <iostream>

#include "census.h"
#include "device_memory.h"
#include "gpu_timing.h"
#include "net.h"
#include "train_net.h"

namespace {

rung::NetOptions options(const ladder::Args& a) {
  if (a.get("device", "cuda") != "cuda") throw std::runtime_error("the cudnn rung runs on --device cuda only");
  rung::Precision p = rung::Precision::parse(a.get("dtype"));
  // 16-bit data goes NHWC (the tensor-core layout); fp32/tf32 take the cell's layout, so both are measurable.
  bool nhwc = p.storage != rung::Storage::F32 || a.flag("channels-last");
  // Engine tables: --tunings (shipped for this GPU model; absent under --retune) and the run's own in --cache-dir,
  // to which choices tuned here are appended.
  std::vector<std::string> tables;
  if (!a.get("tunings", "").empty()) tables.push_back(a.get("tunings"));
  const std::string own = a.get("cache-dir", "").empty() ? "" : a.get("cache-dir") + "/engines.tsv";
  if (!own.empty()) tables.push_back(own);
  // At batch 256 strict fp32's fast engines need about 1 GiB of workspace (the measurements:
  // docs/notes/handwritten-toward-the-limit.md, results/.../checks/cudnn-fp32-workspace/). The workspace actually
  // kept is the most the chosen engines need.
  return {a.i("batch"), a.i("res"), p, nhwc, {std::stoi(a.option("autotune", "8")), a.flag("cuda-graph")},
          std::stoull(a.option("workspace-mb", "2048")) << 20, tables, own};
}

// The cell as this rung reads it, checked before any CUDA call (so that the CPU test can see it parse).
struct Setup {
  rung::NetOptions net;
  bool train;
  float lr;         // training: core/train.py LEARNING_RATE, through the contract
  int parity_steps;  // training: the steps whose losses go into the output file
};

Setup setup(const ladder::Args& a) {
  Setup s{options(a), a.get("task", "infer") == "train", 0.f, std::stoi(a.get("parity-steps", "1"))};
  if (!s.train) return s;
  if (s.net.precision.storage == rung::Storage::F16)
    throw std::runtime_error("fp16 training needs a gradient scaler, which the cudnn rung lacks (bf16 trains)");
  if (!s.net.nhwc)
    throw std::runtime_error("the cudnn rung trains channels-last only (its BatchNorm kernels are NHWC)");
  s.lr = float(a.d("lr"));
  return s;
}

std::unique_ptr<rung::Network> network(const Setup& s, const ladder::TensorMap& weights,
                                       const ladder::HostTensor& input, cudaStream_t stream, ladder::Json& stats) {
  if (s.train) return std::make_unique<rung::ResNet50Train>(s.net, s.lr, weights, input, stream, stats);
  return std::make_unique<rung::ResNet50>(s.net, weights, input, stream, stats);
}

cudaStream_t make_stream() {
  cudaStream_t s;
  LADDER_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return s;
}

void versions(ladder::Json& stats) {
  int runtime = 0, device = 0;
  LADDER_CUDA(cudaRuntimeGetVersion(&runtime));
  LADDER_CUDA(cudaGetDevice(&device));
  cudaDeviceProp prop{};
  LADDER_CUDA(cudaGetDeviceProperties(&prop, device));
  stats["device"] = prop.name;
  stats["cudnn_version"] = static_cast<unsigned long long>(cudnnGetVersion());  // the library actually loaded
  stats["cudnn_header_version"] = CUDNN_VERSION;
  stats["cublaslt_version"] = static_cast<unsigned long long>(cublasLtGetVersion());
  stats["cuda_runtime_version"] = runtime;
}

class CudnnRung : public ladder::Rung {
 public:
  CudnnRung(const ladder::Args& a, const ladder::TensorMap& weights, const ladder::HostTensor& input,
            ladder::Json& stats)
      : setup_(setup(a)), stream_(make_stream()) {
    versions(stats);
    net_ = network(setup_, weights, input, stream_, stats);
    // One eager pass first: lazily loaded kernel modules must not load during a capture. A training step's update
    // is undone, so that the first measured step starts from the run's weights.
    net_->issue();
    LADDER_CUDA(cudaStreamSynchronize(stream_));
    net_->reset();
    stats["cuda_graph"] = a.flag("cuda-graph");
    if (!a.flag("cuda-graph")) return;
    size_t nodes = 0;
    exec_ = rung::capture_graph(stream_, [&] { net_->issue(); }, &nodes);
    stats["cuda_graph_nodes"] = static_cast<unsigned long long>(nodes);
  }
  ~CudnnRung() override {
    if (exec_) cudaGraphExecDestroy(exec_);
    net_.reset();
    cudaStreamDestroy(stream_);
  }

  void forward() override {
    if (exec_) LADDER_CUDA(cudaGraphLaunch(exec_, stream_));
    else net_->issue();
  }
  cudaStream_t stream() const override { return stream_; }
  std::string stream_description() const override {
    return std::string("cudaStreamNonBlocking created by rung") + (exec_ ? ", each call one CUDA graph" : "");
  }
  void* device_input() override { return net_->input(); }
  size_t input_bytes() const override { return net_->input_bytes(); }
  void* device_output() override { return net_->output(); }
  size_t output_bytes() const override { return net_->output_bytes(); }
  ladder::HostTensor output_fp32() override { return net_->result(1).at("output"); }  // inference's logits
  ladder::TensorMap result_tensors() override { return net_->result(setup_.parity_steps); }
  void set_batch(const ladder::HostTensor& x, const std::vector<int>& labels) override { net_->set_batch(x, labels); }
  void set_learning_rate(double lr) override {
    // A captured step replays the rate it was captured with (SGD's launch argument).
    if (exec_) throw std::runtime_error("a learning-rate schedule cannot change a captured CUDA graph's step");
    net_->set_learning_rate(float(lr));
  }
  ladder::TensorMap state() override { return net_->state(); }
  // CUPTI's records of each call, issued step by step inside ranges that name each step's layer; under a CUDA
  // graph one launch replays every step, so only the call's range is there and the kernels stay unattributed.
  ladder::Json census(int steps, const std::string& path) override {
#ifdef LADDER_CUPTI
    rung::CuptiTrace trace;
    for (int i = 0; i < steps; ++i) {
      const auto call = rung::CuptiTrace::now();
      for (size_t k = 0; !exec_ && k < net_->step_count(); ++k) {
        const auto [layer, pass] = net_->step_layer(k);
        const auto t = rung::CuptiTrace::now();
        net_->issue_step(k);
        ladder::Json args = ladder::Json::object();
        if (!layer.empty()) {  // harness/run/census.py (core/layers.py) LAYER, BASIS and PHASE
          args["census layer"] = layer;
          args["census basis"] = "the rung's schedule";
          args["census phase"] = pass;
        }
        trace.range(layer.empty() ? "unnamed step" : layer, t, rung::CuptiTrace::now(), args);
      }
      if (exec_) forward();
      LADDER_CUDA(cudaStreamSynchronize(stream_));
      trace.range(ladder::CENSUS_STEP, call, rung::CuptiTrace::now(), ladder::Json::object());
    }
    trace.write(path);
    ladder::Json out = ladder::Json::object();
    out["steps"] = steps;
    out["source"] = "CUPTI activity API (kernels, copies, memsets, runtime and driver calls)";
    out["module_scopes"] = !exec_;
    return out;
#else
    return ladder::Rung::census(steps, path);  // built without CUPTI: says so
#endif
  }

  void reset_memory_peak() override { rung::Ledger::get().peak = rung::Ledger::get().live; }
  void report_memory(ladder::Json& memory) override {
    // Every byte of the rung is its own cudaMalloc (no caching allocator): reserved == allocated.
    memory["allocator_peak_bytes"] = static_cast<unsigned long long>(rung::Ledger::get().peak);
    memory["allocator_reserved_peak_bytes"] = static_cast<unsigned long long>(rung::Ledger::get().peak);
    net_->report_memory(memory);
  }

 private:
  Setup setup_;
  cudaStream_t stream_;
  std::unique_ptr<rung::Network> net_;
  cudaGraphExec_t exec_ = nullptr;
};

int micro(const ladder::Args& a) {
  ladder::TensorMap weights = ladder::read_safetensors(a.get("weights"));
  ladder::HostTensor input = ladder::read_safetensors(a.get("input")).at("input");
  ladder::Json stats = ladder::Json::object();
  cudaStream_t stream = make_stream();
  ladder::Json list;
  {
    list = network(setup(a), weights, input, stream, stats)->micro(std::stoi(a.option("micro-reps", "20")));
  }
  cudaStreamDestroy(stream);
  std::cout << "@@micro " << list.dump() << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    ladder::Args a = ladder::Args::parse(argc, argv);
    if (a.flag("micro")) return micro(a);
  } catch (const std::exception& e) {
    std::cout << "@@error " << e.what() << std::endl;
    return 1;
  }
  return ladder::run_child(argc, argv, [](const ladder::Args& a, const ladder::TensorMap& w,
                                          const ladder::HostTensor& in, ladder::Json& stats) {
    return std::unique_ptr<ladder::Rung>(new CudnnRung(a, w, in, stats));
  });
}
