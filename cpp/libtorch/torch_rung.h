// What the two LibTorch rungs share: the cell's device, precision and layout, the rung's own CUDA stream, the
// optional CUDA graph and the caching allocator's figures. A rung only says how to build its network (`Net`).
#pragma once
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
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

// The network: device input (cell dtype and layout) -> logits.
using Net = std::function<torch::Tensor(const torch::Tensor&)>;

inline torch::Dtype parse_dtype(const std::string& d) {
  if (d == "fp32" || d == "tf32") return torch::kFloat;
  if (d == "fp16") return torch::kHalf;
  if (d == "bf16") return torch::kBFloat16;
  throw std::runtime_error("unknown --dtype " + d);
}

class TorchRung : public ladder::Rung {
 public:
  // `make_net` builds the network for `Config`; it runs as every call into torch here does (see `guarded`).
  // `inference_mode`: run under c10::InferenceMode as the Python eager rung does (TorchScript's frozen graphs
  // reject inference tensors, so the TorchScript rungs, Python and C++, run under no-grad only).
  TorchRung(const Args& a, const HostTensor& input, Json& stats, bool inference_mode,
            const std::function<Net(const Config&)>& make_net)
      : inference_mode_(inference_mode) {
    Config cfg = guarded([&] { return configure(a, stats); });  // creates the stream the next call runs on
    guarded([&] {
      net_ = make_net(cfg);
      input_ = torch::from_blob(const_cast<float*>(input.data.data()), input.shape, torch::kFloat)
                   .to(cfg.device, cfg.dtype)
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
    });
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
    return guarded([&] {
      torch::Tensor out = output_.to(torch::kCPU, torch::kFloat).contiguous();  // waits for the rung's stream
      HostTensor h;
      h.shape = out.sizes().vec();
      h.data.assign(out.data_ptr<float>(), out.data_ptr<float>() + out.numel());
      return h;
    });
  }

  void reset_memory_peak() override {
    if (stream_) guarded([&] { c10::cuda::CUDACachingAllocator::resetPeakStats(stream_->device_index()); });
  }
  void report_memory(Json& memory) override {
    if (!stream_) return;  // on the CPU the allocator figures stay null
    auto s = guarded([&] { return c10::cuda::CUDACachingAllocator::getDeviceStats(stream_->device_index()); });
    // Index 0 is StatType::AGGREGATE (all pools); the enum's namespace differs between torch versions.
    memory["allocator_peak_bytes"] = static_cast<long long>(s.allocated_bytes[0].peak);
    memory["allocator_reserved_peak_bytes"] = static_cast<long long>(s.reserved_bytes[0].peak);
  }

 private:
  // Runs `f` as every call into torch here must run: on the rung's stream (once it exists), in the rung's autograd
  // mode, and with torch's errors (whose what() carries a multi-line C++ backtrace) turned into one-line messages
  // for the contract's @@error.
  template <class F>
  auto guarded(F&& f) -> decltype(f()) {
    try {
      std::optional<c10::cuda::CUDAStreamGuard> on_stream;
      if (stream_) on_stream.emplace(*stream_);
      c10::InferenceMode inference(inference_mode_);
      torch::NoGradGuard no_grad;  // InferenceMode(false) turns grad mode on
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
      cfg.device = torch::Device(torch::kCUDA, 0);  // cuDNN benchmark mode stays off, as in the Python rungs
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

  const bool inference_mode_;
  std::optional<c10::cuda::CUDAStream> stream_;  // none on the CPU
  Net net_;
  torch::Tensor input_, output_;
  std::optional<at::cuda::CUDAGraph> graph_;
};

}  // namespace ladder_torch
