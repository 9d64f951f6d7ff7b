// The `torchscript-cpp` rung: the TorchScript module that the Python `torchscript` rung runs, loaded with
// torch::jit::load and run with no Python in the process. tiers/exports/torchscript.py traces and freezes it in the
// cell's dtype and layout on its device; the parent does that before starting this child (TorchScriptCpp.prepare
// in tiers/libtorch.py) and passes `--option ts-path=PATH --option export-s=SECONDS`. optimize_for_inference, the
// recipe's last step, runs here: its CPU output cannot be serialised.
#include <torch/script.h>

#include "torch_rung.h"

namespace {

using namespace ladder_torch;

std::unique_ptr<ladder::Rung> build(const Args& a, const ladder::TensorMap&, const HostTensor& input, Json& stats) {
  const std::string path = a.option("ts-path", "");
  if (path.empty())
    throw std::runtime_error("torchscript-cpp needs --option ts-path=PATH (written by tiers/exports/torchscript.py)");
  // The export ran in the parent, outside this child's build phase: recorded here so that it is not lost.
  if (a.options.count("export-s")) stats["parent_export_s"] = std::stod(a.option("export-s", ""));
  return std::make_unique<TorchRung>(a, input, stats, Mode::kNoGrad, [&](const Config& cfg) -> Net {
    torch::jit::Module module = torch::jit::load(path, cfg.device);
    module = torch::jit::optimize_for_inference(module);
    return [module](const torch::Tensor& x) mutable { return module.forward({x}).toTensor(); };
  });
}

}  // namespace

int main(int argc, char** argv) { return ladder::run_child(argc, argv, build); }
