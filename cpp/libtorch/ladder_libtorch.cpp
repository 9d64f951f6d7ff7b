// The `libtorch` rung: torchvision's ResNet family written natively with torch::nn, no Python in the process.
// Module and attribute names follow torchvision exactly, so the contract's weights file (a torchvision
// state_dict) loads by name: `layer1.0.downsample.1.running_var` is the same path here as there.
// With --task train each call is the training step of core/train.py, in C++: BatchNorm in training mode,
// cross-entropy against the same fixed labels, backward, torch::optim::SGD (momentum 0.9, weight decay 1e-4,
// lr from the contract); bf16 means autocast over fp32 master weights.
#include <ATen/autocast_mode.h>

#include "torch_rung.h"

namespace {

using namespace ladder_torch;

torch::nn::Conv2d conv(int64_t in, int64_t out, int64_t k, int64_t stride = 1, int64_t groups = 1) {
  return torch::nn::Conv2d(
      torch::nn::Conv2dOptions(in, out, k).stride(stride).padding(k / 2).groups(groups).bias(false));
}

// torchvision's BasicBlock (two 3x3 convs) or Bottleneck (1x1, 3x3, 1x1; the stride on the 3x3 as in "ResNet v1.5").
struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t in, int64_t planes, int64_t stride, bool bottleneck, int64_t groups, int64_t base_width) {
    const int64_t expansion = bottleneck ? 4 : 1;
    const int64_t width = bottleneck ? planes * base_width / 64 * groups : planes;
    if (bottleneck) {
      conv1 = register_module("conv1", conv(in, width, 1));
      conv2 = register_module("conv2", conv(width, width, 3, stride, groups));
      conv3 = register_module("conv3", conv(width, planes * expansion, 1));
      bn3 = register_module("bn3", torch::nn::BatchNorm2d(planes * expansion));
    } else {
      conv1 = register_module("conv1", conv(in, planes, 3, stride));
      conv2 = register_module("conv2", conv(planes, planes, 3));
    }
    bn1 = register_module("bn1", torch::nn::BatchNorm2d(width));
    bn2 = register_module("bn2", torch::nn::BatchNorm2d(width));
    if (stride != 1 || in != planes * expansion)
      downsample = register_module(
          "downsample", torch::nn::Sequential(conv(in, planes * expansion, 1, stride),
                                              torch::nn::BatchNorm2d(planes * expansion)));
  }

  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor out = torch::relu(bn1(conv1(x)));
    out = bn2(conv2(out));
    if (conv3) out = bn3(conv3(torch::relu(out)));
    out += downsample ? downsample->forward(x) : x;
    return torch::relu(out);
  }

  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr}, conv3{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr}, bn2{nullptr}, bn3{nullptr};
  torch::nn::Sequential downsample{nullptr};
};
TORCH_MODULE(Block);

struct Spec {
  std::vector<int64_t> layers;
  bool bottleneck;
  int64_t groups = 1, base_width = 64;
};

// torchvision.models.resnet's constructors.
const std::map<std::string, Spec> kModels = {
    {"resnet18", {{2, 2, 2, 2}, false}},
    {"resnet34", {{3, 4, 6, 3}, false}},
    {"resnet50", {{3, 4, 6, 3}, true}},
    {"resnet101", {{3, 4, 23, 3}, true}},
    {"resnet152", {{3, 8, 36, 3}, true}},
    {"wide_resnet50_2", {{3, 4, 6, 3}, true, 1, 128}},
    {"resnext50_32x4d", {{3, 4, 6, 3}, true, 32, 4}},
};

struct ResNetImpl : torch::nn::Module {
  ResNetImpl(const Spec& s, int64_t classes) {
    conv1 = register_module("conv1", conv(3, 64, 7, 2));
    bn1 = register_module("bn1", torch::nn::BatchNorm2d(64));
    int64_t in = 64;
    for (size_t i = 0; i < 4; ++i) {
      const int64_t planes = 64 << i;
      torch::nn::Sequential layer;
      for (int64_t b = 0; b < s.layers[i]; ++b) {
        layer->push_back(Block(in, planes, b == 0 && i > 0 ? 2 : 1, s.bottleneck, s.groups, s.base_width));
        in = planes * (s.bottleneck ? 4 : 1);
      }
      layers.push_back(register_module("layer" + std::to_string(i + 1), layer));
    }
    fc = register_module("fc", torch::nn::Linear(in, classes));
  }

  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor y = torch::max_pool2d(torch::relu(bn1(conv1(x))), {3, 3}, {2, 2}, {1, 1});
    for (auto& layer : layers) y = layer->forward(y);
    return fc(torch::adaptive_avg_pool2d(y, {1, 1}).flatten(1));
  }

  torch::nn::Conv2d conv1{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr};
  std::vector<torch::nn::Sequential> layers;
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(ResNet);

// Copies the weights file into the network by name; any name on one side only, or any shape that differs, is an
// error, except batch-norm's `num_batches_tracked` counters: inference never reads them and the contract leaves
// them out.
void load_weights(torch::nn::Module& net, const ladder::TensorMap& weights, const std::string& model) {
  std::map<std::string, torch::Tensor> own;
  for (auto& p : net.named_parameters()) own[p.key()] = p.value();
  for (auto& b : net.named_buffers()) own[b.key()] = b.value();
  std::vector<std::string> missing, unexpected, mismatched;
  for (auto& kv : own)
    if (!weights.count(kv.first) && kv.first.find("num_batches_tracked") == std::string::npos)
      missing.push_back(kv.first);
  for (auto& kv : weights) {
    auto it = own.find(kv.first);
    if (it == own.end()) {
      unexpected.push_back(kv.first);
    } else if (it->second.sizes().vec() != kv.second.shape) {
      mismatched.push_back(kv.first);
    } else {
      it->second.copy_(torch::from_blob(const_cast<float*>(kv.second.data.data()), kv.second.shape, torch::kFloat));
    }
  }
  if (missing.empty() && unexpected.empty() && mismatched.empty()) return;
  auto some = [](const std::vector<std::string>& v) {
    std::string s = std::to_string(v.size()) + " [";
    for (size_t i = 0; i < v.size() && i < 3; ++i) s += (i ? ", " : "") + v[i];
    return s + (v.size() > 3 ? ", ...]" : "]");
  };
  throw std::runtime_error("weights file does not match " + model + ": missing " + some(missing) + ", unexpected " +
                           some(unexpected) + ", wrong shape " + some(mismatched));
}

// The training step of core/train.py (make_step) on `net`, which is on the device in fp32, in train mode, against
// `labels`: core/train.py labels until a batch of data sets them (set_batch); `learning_rate` gets the setter of its
// rate (set_learning_rate).
Net training_step(ResNet net, const Config& cfg, const Args& a, int64_t batch, std::shared_ptr<torch::Tensor> labels,
                  std::function<void(double)>& learning_rate) {
  const double lr = a.d("lr");  // core/train.py LEARNING_RATE, through the contract
  auto optimizer = std::make_shared<torch::optim::SGD>(
      net->parameters(), torch::optim::SGDOptions(lr).momentum(0.9).weight_decay(1e-4));
  learning_rate = [optimizer](double rate) {
    for (auto& group : optimizer->param_groups()) static_cast<torch::optim::SGDOptions&>(group.options()).lr(rate);
  };
  *labels = (torch::arange(batch, torch::TensorOptions(cfg.device).dtype(torch::kLong)) * 7919) %
            net->fc->options.out_features();
  const std::string dtype = a.get("dtype");
  if (dtype == "fp16") throw std::runtime_error("fp16 training needs a gradient scaler, which LibTorch's C++ API lacks");
  const bool amp = dtype == "bf16";
  const c10::DeviceType device_type = cfg.device.type();
  return [net, optimizer, labels, amp, device_type](const torch::Tensor& x) mutable {
    optimizer->zero_grad(/*set_to_none=*/true);
    torch::Tensor loss;
    {
      // autocast as Python's torch.autocast(device, bfloat16): on for the forward and the loss, then off and its
      // cache of cast weights cleared (the weights change with every step)
      at::autocast::set_autocast_enabled(device_type, amp);
      if (amp) at::autocast::set_autocast_dtype(device_type, at::kBFloat16);
      loss = torch::nn::functional::cross_entropy(net->forward(x), labels->slice(0, 0, x.size(0)));
      at::autocast::set_autocast_enabled(device_type, false);
      at::autocast::clear_cache();
    }
    loss.backward();
    optimizer->step();
    return loss.detach();
  };
}

// Parameters and floating-point buffers by name, as core/train.py state_of.
ladder::TensorMap state_of(torch::nn::Module& net) {
  ladder::TensorMap out;
  for (auto& p : net.named_parameters()) out["param." + p.key()] = TorchRung::host_fp32(p.value());
  for (auto& b : net.named_buffers())
    if (b.value().is_floating_point()) out["buffer." + b.key()] = TorchRung::host_fp32(b.value());
  return out;
}

std::unique_ptr<ladder::Rung> build(const Args& a, const ladder::TensorMap& weights, const HostTensor& input,
                                    Json& stats) {
  const std::string model = a.get("model");
  auto spec = kModels.find(model);
  if (spec == kModels.end()) throw std::runtime_error("the libtorch rung implements only the ResNet family, not " + model);
  const int64_t classes = weights.count("fc.weight") ? weights.at("fc.weight").shape[0] : 1000;
  if (a.get("task", "infer") == "train") {
    ResNet net(spec->second, classes);
    long long weights_bytes = 0;
    auto labels = std::make_shared<torch::Tensor>();
    std::function<void(double)> learning_rate;
    auto rung = std::make_unique<TorchRung>(a, input, stats, Mode::kTrain, [&](const Config& cfg) -> Net {
      net->train();
      {
        torch::NoGradGuard no_grad;  // copying into parameters that require grad
        load_weights(*net, weights, model);
      }
      net->to(cfg.device);  // fp32 master weights (to(device, dtype) would make the step counters float too)
      for (auto& p : net->parameters()) {
        if (p.dim() == 4) p.set_data(p.contiguous(cfg.memory_format));
        weights_bytes += p.numel() * 4;
      }
      stats["optimizer"] = "torch::optim::SGD (momentum 0.9, weight decay 1e-4)";
      return training_step(net, cfg, a, a.i("batch"), labels, learning_rate);
    }, [net]() mutable { return state_of(*net); });
    rung->weights_bytes = weights_bytes;
    rung->labels = labels;
    rung->learning_rate = learning_rate;
    return rung;
  }
  return std::make_unique<TorchRung>(a, input, stats, Mode::kInference, [&](const Config& cfg) -> Net {
    ResNet net(spec->second, classes);
    net->eval();
    load_weights(*net, weights, model);
    net->to(cfg.device, cfg.dtype);
    // torch::nn::Module::to has no memory-format overload; Python's does this to every 4-d tensor.
    for (auto& p : net->parameters())
      if (p.dim() == 4) p.set_data(p.contiguous(cfg.memory_format));
    int64_t params = 0;
    for (auto& p : net->parameters()) params += p.numel();
    stats["parameters"] = static_cast<long long>(params);
    return [net](const torch::Tensor& x) mutable { return net->forward(x); };
  });
}

}  // namespace

int main(int argc, char** argv) { return ladder::run_child(argc, argv, build); }
