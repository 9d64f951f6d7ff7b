// The `aot-inductor-cpp` rung: the AOTInductor package that the Python `aot-inductor` rung runs (torch.export with a
// dynamic batch, compiled ahead of time by Inductor), loaded with torch::inductor::AOTIModelPackageLoader and run
// with no Python in the process. The parent builds or finds the package before starting this child
// (tiers/exports/aot_inductor.py) and passes `--option pt2-path=PATH` with the export's costs, which are recorded
// here so that the deployment's life cycle reads from one record.
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include "torch_rung.h"

namespace {

using namespace ladder_torch;

std::unique_ptr<ladder::Rung> build(const Args& a, const ladder::TensorMap&, const HostTensor& input, Json& stats) {
  const std::string path = a.option("pt2-path", "");
  if (path.empty())
    throw std::runtime_error("aot-inductor-cpp needs --option pt2-path=PATH (written by tiers/exports/aot_inductor.py)");
  // The package's costs, as the Python rung reports them (tiers/exports/aot_inductor.py).
  stats["export_s"] = std::stod(a.option("export-s", "0"));
  stats["aot_compile_s"] = std::stod(a.option("aot-compile-s", "0"));
  stats["package_bytes"] = std::stoll(a.option("package-bytes", "0"));
  stats["traced_batch"] = std::stoi(a.option("traced-batch", "0"));
  stats["cached"] = a.option("cached", "0") == "1";
  stats["mode"] = a.option("mode", "default");
  stats["batch_dim"] = a.option("batch-dim", "dynamic");
  stats["package"] = path.substr(path.find_last_of('/') + 1);
  // tiers/exports/aot_inductor.py RUNNERS: single-threaded, or the loader's default pool (each call waits for the
  // pooled model's previous call to finish).
  const std::string runner = a.option("runner", "single-threaded");
  if (runner != "single-threaded" && runner != "pooled")
    throw std::runtime_error("aot-inductor-cpp runner " + runner + "; valid: single-threaded, pooled");
  stats["runner"] = runner;
  return std::make_unique<TorchRung>(a, input, stats, Mode::kInference, [&](const Config& cfg) -> Net {
    const double t = ladder::now_s();
    auto loader = std::make_shared<torch::inductor::AOTIModelPackageLoader>(path, "model",
                                                                             runner == "single-threaded");
    stats["package_load_s"] = ladder::now_s() - t;
    const bool gpu = cfg.device.is_cuda();
    return [loader, gpu](const torch::Tensor& x) {
      // On the GPU the package runs on the current stream: the rung's (TorchRung makes it current).
      void* stream = gpu ? static_cast<void*>(c10::cuda::getCurrentCUDAStream().stream()) : nullptr;
      return loader->run({x}, stream)[0];
    };
  });
}

}  // namespace

int main(int argc, char** argv) { return ladder::run_child(argc, argv, build); }
