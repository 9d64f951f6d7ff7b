// What the two LibTorch rungs share: the cell's device, precision and layout, the rung's own CUDA stream, the
// optional CUDA graph and the caching allocator's figures. A rung only says how to build its network (`Net`).
#pragma once
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/torch.h>

#include <optional>

#include <ladder/protocol.h>

namespace ladder_torch {

using ladder::Args;
using ladder::HostTensor;
using ladder::Json;

// How the rung's network is laid out on the device.
struct Config {
  torch::Device device = torch::kCPU;
  torch::Dtype dtype = torch::kFloat;
  at::MemoryFormat memory_format = at::MemoryFormat::Contiguous;
};

// The network: device input (cell dtype and layout) -> logits; for a training rung, one training step: input ->
// loss.
using Net = std::function<torch::Tensor(const torch::Tensor&)>;

// The autograd mode every call into torch runs in: InferenceMode (as the Python eager rung), no-grad (TorchScript's
// frozen graphs reject inference tensors, so the TorchScript rungs run under no-grad only), or grad (training).
enum class Mode { kInference, kNoGrad, kTrain };

inline torch::Dtype parse_dtype(const std::string& d) {
  if (d == "fp32" || d == "tf32") return torch::kFloat;
  if (d == "fp16") return torch::kHalf;
  if (d == "bf16") return torch::kBFloat16;
  throw std::runtime_error("unknown --dtype " + d);
}

class TorchRung : public ladder::Rung {
 public:
  // `make_net` builds the network for `Config`; it runs as every call into torch here does (see `guarded`).
  // In training (kTrain) the input stays fp32 (bf16 means autocast) and `state` gives the parameters and
  // floating-point buffers by name, for parity after the first `parity_steps` steps.
  TorchRung(const Args& a, const HostTensor& input, Json& stats, Mode mode,
            const std::function<Net(const Config&)>& make_net,
            std::function<ladder::TensorMap()> state = nullptr)
      : mode_(mode), parity_steps_(std::stoi(a.get("parity-steps", "1"))), state_(std::move(state)) {
    Config cfg = guarded([&] { return configure(a, stats); });  // creates the stream the next call runs on
    guarded([&] {
      net_ = make_net(cfg);
      input_ = torch::from_blob(const_cast<float*>(input.data.data()), input.shape, torch::kFloat)
                   .to(cfg.device, mode == Mode::kTrain ? torch::kFloat : cfg.dtype)
                   .contiguous(cfg.memory_format);
      if (a.flag("cuda-graph")) capture();
    });
  }

  void forward() override {
    guarded([&] {
      if (graph_)
        graph_->replay();  // on the current stream: the rung's, through the guard
      else
        output_ = net_(input_);
      if (state_ && losses_.size() < static_cast<size_t>(parity_steps_)) losses_.push_back(output_);
    });
  }

  // Training on data: the batch and its labels copied into the buffers the step reads (a CUDA graph keeps them).
  void set_batch(const HostTensor& x, const std::vector<int>& labels_in) override {
    if (!labels) throw std::runtime_error("this rung does not train on data");
    guarded([&] {
      input_.copy_(torch::from_blob(const_cast<float*>(x.data.data()), x.shape, torch::kFloat));
      labels->copy_(torch::from_blob(const_cast<int*>(labels_in.data()), {int64_t(labels_in.size())}, torch::kInt));
    });
  }
  void set_learning_rate(double lr) override {
    if (!learning_rate) throw std::runtime_error("this rung does not train on data");
    // A captured step replays the rate it was captured with.
    if (graph_) throw std::runtime_error("a learning-rate schedule cannot change a captured CUDA graph's step");
    learning_rate(lr);
  }
  ladder::TensorMap state() override {
    if (!state_) return ladder::Rung::state();
    return guarded([&] { return state_(); });
  }

  ladder::TensorMap result_tensors() override {
    if (!state_) return ladder::Rung::result_tensors();
    return guarded([&] {
      ladder::TensorMap out = state_();
      out["loss"] = host_fp32(torch::stack(losses_));
      return out;
    });
  }

  // A tensor as the contract's fp32 host copy (waits for the rung's stream).
  static HostTensor host_fp32(const torch::Tensor& t) {
    torch::Tensor c = t.detach().to(torch::kCPU, torch::kFloat).contiguous();
    HostTensor h;
    h.shape = c.sizes().vec();
    h.data.assign(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
    return h;
  }

  cudaStream_t stream() const override { return stream_ ? stream_->stream() : nullptr; }
  std::string stream_description() const override {
    return stream_ ? "c10 CUDA stream from the pool (getStreamFromPool), made current with CUDAStreamGuard"
                   : "none (CPU)";
  }
  void* device_input() override { return input_.data_ptr(); }
  size_t input_bytes() const override { return input_.nbytes(); }
  void* device_output() override { return output_.data_ptr(); }
  size_t output_bytes() const override { return output_.nbytes(); }

  HostTensor output_fp32() override {
    return guarded([&] { return host_fp32(output_); });
  }

  // libtorch's own profiler (Kineto, CUPTI on the GPU), as torch.profiler in the Python rungs: input shapes (the
  // census matches convolutions by weight shape) and TorchScript's module hierarchy recorded.
  Json census(int steps, const std::string& path) override {
    namespace prof = torch::autograd::profiler;
    using torch::profiler::impl::ActivityType;
    const prof::ProfilerConfig config(prof::ProfilerState::KINETO, /*report_input_shapes=*/true,
                                      /*profile_memory=*/false, /*with_stack=*/false, /*with_flops=*/false,
                                      /*with_modules=*/true);
    std::set<ActivityType> activities{ActivityType::CPU};
    if (stream_) activities.insert(ActivityType::CUDA);
    prof::prepareProfiler(config, activities);
    prof::enableProfiler(config, activities);
    for (int i = 0; i < steps; ++i) {
      RECORD_USER_SCOPE(ladder::CENSUS_STEP);
      forward();
      if (stream_) LADDER_CUDA(cudaStreamSynchronize(stream_->stream()));
    }
    prof::disableProfiler()->save(path);
    Json out = Json::object();
    out["steps"] = steps;
    out["source"] = std::string("libtorch profiler (Kineto") + (stream_ ? ", CUPTI)" : ", CPU operators)");
    out["module_scopes"] = false;
    return out;
  }

  void reset_memory_peak() override {
    if (stream_) guarded([&] { c10::cuda::CUDACachingAllocator::resetPeakStats(stream_->device_index()); });
  }
  void report_memory(Json& memory) override {
    // As harness/child/worker.py: what a training rung knows of its memory, and the rest of the allocator's peak.
    if (mode_ == Mode::kTrain && weights_bytes > 0)
      memory["weights_bytes"] = memory["gradient_bytes"] = memory["optimizer_state_bytes"] = weights_bytes;
    if (!stream_) return;  // on the CPU the allocator figures stay null
    auto s = guarded([&] { return c10::cuda::CUDACachingAllocator::getDeviceStats(stream_->device_index()); });
    // Index 0 is StatType::AGGREGATE (all pools); the enum's namespace differs between torch versions.
    const long long peak = static_cast<long long>(s.allocated_bytes[0].peak);
    memory["allocator_peak_bytes"] = peak;
    memory["allocator_reserved_peak_bytes"] = static_cast<long long>(s.reserved_bytes[0].peak);
    if (mode_ == Mode::kTrain && weights_bytes > 0)
      memory["activations_and_workspace_bytes"] = peak - static_cast<long long>(input_.nbytes()) - 3 * weights_bytes;
  }

  long long weights_bytes = 0;  // training: fp32 master weights (gradients and momentum are the same size)
  std::shared_ptr<torch::Tensor> labels;  // training: the class labels the step reads, on the device
  std::function<void(double)> learning_rate;  // training: sets the optimizer's rate for the next steps

 private:
  // Runs `f` as every call into torch here must run: on the rung's stream (once it exists), in the rung's autograd
  // mode, and with torch's errors (whose what() carries a multi-line C++ backtrace) turned into one-line messages
  // for the contract's @@error.
  template <class F>
  auto guarded(F&& f) -> decltype(f()) {
    try {
      std::optional<c10::cuda::CUDAStreamGuard> on_stream;
      if (stream_) on_stream.emplace(*stream_);
      c10::InferenceMode inference(mode_ == Mode::kInference);
      std::optional<torch::NoGradGuard> no_grad;  // InferenceMode(false) turns grad mode on
      if (mode_ != Mode::kTrain) no_grad.emplace();
      return f();
    } catch (const c10::Error& e) {
      throw std::runtime_error(e.what_without_backtrace());
    }
  }

  Config configure(const Args& a, Json& stats) {
    Config cfg;
    cfg.dtype = parse_dtype(a.get("dtype"));
    if (a.flag("channels-last")) cfg.memory_format = at::MemoryFormat::ChannelsLast;
    const bool tf32 = a.get("dtype") == "tf32";
    // fp32 is strict: TF32 off in cuDNN (conv) and cuBLAS (fc) alike. These setters exist in every torch 2.x.
    at::globalContext().setAllowTF32CuDNN(tf32);
    at::globalContext().setAllowTF32CuBLAS(tf32);
    stats["tf32"] = tf32;
    stats["cuda_graph"] = a.flag("cuda-graph");
    if (a.on_gpu()) {
      if (!torch::cuda::is_available()) throw std::runtime_error("--device cuda but torch sees no CUDA device");
      cfg.device = torch::Device(torch::kCUDA, 0);
      // cuDNN's benchmark mode, on unless the cell says off (tiers/base.py CUDNN_BENCHMARK, the Python rungs' rule)
      const bool benchmark = a.option("cudnn-benchmark", "on") == "on";
      at::globalContext().setBenchmarkCuDNN(benchmark);
      stats["cudnn_benchmark"] = benchmark;
      // A process measuring several cells in turn: the previous cell's cached blocks go back first, as the Python
      // worker's torch.cuda.empty_cache() does, so that each cell's memory figures are its own.
      c10::cuda::CUDACachingAllocator::emptyCache();
      stream_ = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, cfg.device.index());
    } else if (a.flag("cuda-graph")) {
      throw std::runtime_error("CUDA graphs need --device cuda");
    }
    return cfg;
  }

  // Captures one forward into a CUDA graph on the rung's stream (a side stream, as capture requires). Eager calls
  // first, so that lazy workspace allocation and the TorchScript profiling executor's specialisation happen
  // outside the capture; the output then lives in the graph's private memory pool, rewritten by each replay.
  void capture() {
    for (int i = 0; i < 3; ++i) output_ = net_(input_);
    LADDER_CUDA(cudaStreamSynchronize(stream_->stream()));
    graph_.emplace();
    graph_->capture_begin();
    output_ = net_(input_);
    graph_->capture_end();
    LADDER_CUDA(cudaStreamSynchronize(stream_->stream()));
  }

  const Mode mode_;
  const int parity_steps_;
  std::function<ladder::TensorMap()> state_;  // training only
  std::vector<torch::Tensor> losses_;          // training: the losses of the parity steps
  std::optional<c10::cuda::CUDAStream> stream_;  // none on the CPU
  Net net_;
  torch::Tensor input_, output_;
  std::optional<at::cuda::CUDAGraph> graph_;
};

}  // namespace ladder_torch
