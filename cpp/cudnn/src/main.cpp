// The `cudnn` rung: an exact torchvision ResNet-50 from cuDNN, cuBLASLt and a little CUDA of our own, measured by
// the ladder's protocol (cpp/common/ladder/protocol.h). With `--micro 1` it instead times each distinct convolution
// of the network alone and prints them as one line `@@micro [...]` (JSON).
#include <iostream>

#include "net.h"

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
  return {a.i("batch"), a.i("res"), p, nhwc, std::stoi(a.option("autotune", "8")),
          std::stoull(a.option("workspace-mb", "512")) << 20, tables, own};
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
      : stream_(make_stream()), batch_(a.i("batch")) {
    versions(stats);
    net_ = std::make_unique<rung::ResNet50>(options(a), weights, input, stream_, stats);
    // One eager pass first: lazily loaded kernel modules must not load during a capture.
    net_->issue();
    LADDER_CUDA(cudaStreamSynchronize(stream_));
    stats["cuda_graph"] = a.flag("cuda-graph");
    if (!a.flag("cuda-graph")) return;
    cudaGraph_t graph;
    LADDER_CUDA(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal));
    net_->issue();
    LADDER_CUDA(cudaStreamEndCapture(stream_, &graph));
    LADDER_CUDA(cudaGraphInstantiate(&exec_, graph, 0));
    size_t nodes = 0;
    LADDER_CUDA(cudaGraphGetNodes(graph, nullptr, &nodes));
    LADDER_CUDA(cudaGraphDestroy(graph));
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
    return std::string("cudaStreamNonBlocking created by rung") + (exec_ ? ", whole forward as one CUDA graph" : "");
  }
  void* device_input() override { return net_->input(); }
  size_t input_bytes() const override { return net_->input_bytes(); }
  void* device_output() override { return net_->output(); }
  size_t output_bytes() const override { return net_->output_bytes(); }
  ladder::HostTensor output_fp32() override { return {{batch_, 1000}, net_->output_fp32()}; }
  void reset_memory_peak() override { rung::Ledger::get().peak = rung::Ledger::get().live; }
  void report_memory(ladder::Json& memory) override {
    // Every byte of the rung is its own cudaMalloc (no caching allocator): reserved == allocated.
    memory["allocator_peak_bytes"] = static_cast<unsigned long long>(rung::Ledger::get().peak);
    memory["allocator_reserved_peak_bytes"] = static_cast<unsigned long long>(rung::Ledger::get().peak);
    net_->report_memory(memory);
  }

 private:
  cudaStream_t stream_;
  int64_t batch_;
  std::unique_ptr<rung::ResNet50> net_;
  cudaGraphExec_t exec_ = nullptr;
};

int micro(const ladder::Args& a) {
  ladder::TensorMap weights = ladder::read_safetensors(a.get("weights"));
  ladder::HostTensor input = ladder::read_safetensors(a.get("input")).at("input");
  ladder::Json stats = ladder::Json::object();
  cudaStream_t stream = make_stream();
  ladder::Json list;
  {
    rung::ResNet50 net(options(a), weights, input, stream, stats);
    list = net.micro(std::stoi(a.option("micro-reps", "20")));
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
