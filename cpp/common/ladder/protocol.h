// The measurement protocol of docs/protocol.md, for C++ rungs. A rung implements `Rung`; its main() is
//   int main(int argc, char** argv) { return ladder::run_child(argc, argv, build_my_rung); }
// and this driver does the phases, the timing and the files exactly as harness/child/worker.py does for Python rungs.
#pragma once
#include <cuda_runtime.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <cstdio>
#include <functional>
#include <iostream>
#include <iterator>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "json.h"
#include "safetensors.h"

namespace ladder {

#define LADDER_CUDA(call)                                                                          \
  do {                                                                                             \
    cudaError_t err_ = (call);                                                                     \
    if (err_ != cudaSuccess)                                                                       \
      throw std::runtime_error(std::string(#call) + ": " + cudaGetErrorString(err_) + " at " +     \
                               __FILE__ + ":" + std::to_string(__LINE__));                         \
  } while (0)

struct Args {
  std::map<std::string, std::string> kv;
  std::map<std::string, std::string> options;  // --option KEY=VALUE
  std::string get(const std::string& k) const {
    auto it = kv.find(k);
    if (it == kv.end()) throw std::runtime_error("missing --" + k);
    return it->second;
  }
  std::string get(const std::string& k, const std::string& dflt) const {
    auto it = kv.find(k);
    return it == kv.end() ? dflt : it->second;
  }
  int i(const std::string& k) const { return std::stoi(get(k)); }
  double d(const std::string& k) const { return std::stod(get(k)); }
  bool flag(const std::string& k) const { return get(k, "0") == "1"; }
  std::string option(const std::string& k, const std::string& dflt) const {
    auto it = options.find(k);
    return it == options.end() ? dflt : it->second;
  }
  bool on_gpu() const { return get("device") == "cuda"; }
  static Args parse(int argc, char** argv) { return parse(std::vector<std::string>(argv + 1, argv + argc)); }
  static Args parse(const std::vector<std::string>& argv) {
    Args a;
    for (size_t i = 0; i + 1 < argv.size(); i += 2) {
      const std::string& k = argv[i];
      if (k.rfind("--", 0) != 0) throw std::runtime_error("bad argument " + k);
      const std::string& v = argv[i + 1];
      if (k == "--option") {
        auto eq = v.find('=');
        a.options[v.substr(0, eq)] = eq == std::string::npos ? "" : v.substr(eq + 1);
      } else {
        a.kv[k.substr(2)] = v;
      }
    }
    return a;
  }
};

// What a C++ rung provides. forward() issues one forward pass of the device-resident input on stream(),
// asynchronously; the driver times it. Input and output buffers are in the rung's own dtype and layout.
struct Rung {
  virtual ~Rung() = default;
  virtual void forward() = 0;
  virtual cudaStream_t stream() const = 0;       // ignored on the CPU
  virtual std::string stream_description() const = 0;
  virtual void* device_input() = 0;
  virtual size_t input_bytes() const = 0;
  virtual void* device_output() = 0;
  virtual size_t output_bytes() const = 0;
  virtual HostTensor output_fp32() = 0;          // logits of the last forward, synchronised, as fp32
  // The output file's tensors: the logits of the first forward or, for a training step (--task train), the loss of
  // each of the --parity-steps first steps and the state after them, named as core/train.py output_tensors.
  virtual TensorMap result_tensors() { return {{"output", output_fp32()}}; }
  virtual void reset_memory_peak() {}
  virtual void report_memory(Json& memory) { (void)memory; }  // allocator peaks, workspace, activations...
  // Training on data (--train-data): the input of the next steps (fp32 NCHW on the host, the cell's batch) and its
  // class labels, and the parameters and floating-point buffers by name (core/train.py state_of) after them.
  virtual void set_batch(const HostTensor& x, const std::vector<int>& labels) {
    (void)x, (void)labels;
    throw std::runtime_error("this rung does not train on data");
  }
  virtual TensorMap state() { throw std::runtime_error("this rung has no training state"); }
  // Training on data: the rate of the next steps (the schedule of --train-data's `lr`, set before each step).
  virtual void set_learning_rate(double lr) {
    (void)lr;
    throw std::runtime_error("this rung does not train on data");
  }
  // The census pass (--census-steps N above 0; harness/child/contract.py CENSUS_KEYS): N forwards, each inside a range
  // named CENSUS_STEP and synchronised, profiled into the Chrome trace at `path`, which harness/run/census.py reads.
  // Returns the result's "census": steps, source, module_scopes; or, from a rung without a profiler, why (error).
  virtual Json census(int steps, const std::string& path) {
    (void)steps, (void)path;
    Json out = Json::object();
    out["error"] = "this rung has no census pass";
    return out;
  }
};

constexpr const char* CENSUS_STEP = "census:step";  // harness/child/contract.py CENSUS_STEP

// Builds the rung from the parsed arguments, the weights and the fp32 NCHW input; records facts in build_stats.
using RungFactory = std::function<std::unique_ptr<Rung>(const Args&, const TensorMap& weights,
                                                        const HostTensor& input, Json& build_stats)>;

inline void phase(const char* name) { std::cout << "@@phase " << name << std::endl; }

inline double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
inline double thread_cpu_us() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec * 1e6 + ts.tv_nsec * 1e-3;
}

// Times a region on the rung's stream with CUDA events (GPU) or the host's steady clock (CPU).
class RegionTimer {
 public:
  RegionTimer(bool gpu, cudaStream_t s) : gpu_(gpu), s_(s) {
    if (gpu_) { LADDER_CUDA(cudaEventCreate(&a_)); LADDER_CUDA(cudaEventCreate(&b_)); }
  }
  ~RegionTimer() { if (gpu_) { cudaEventDestroy(a_); cudaEventDestroy(b_); } }
  void start() { if (gpu_) LADDER_CUDA(cudaEventRecord(a_, s_)); else t0_ = now_s(); }
  void stop() { if (gpu_) LADDER_CUDA(cudaEventRecord(b_, s_)); else t1_ = now_s(); }
  double elapsed_ms() {
    if (!gpu_) return (t1_ - t0_) * 1e3;
    LADDER_CUDA(cudaEventSynchronize(b_));
    float ms = 0;
    LADDER_CUDA(cudaEventElapsedTime(&ms, a_, b_));
    return ms;
  }
 private:
  bool gpu_;
  cudaStream_t s_;
  cudaEvent_t a_{}, b_{};
  double t0_ = 0, t1_ = 0;
};

inline double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Half-width of the median's distribution-free 95% confidence interval relative to the median: order statistics
// at ranks (n - z*sqrt(n))/2 and 1 + (n + z*sqrt(n))/2 (1-based), as core/stats.py median_ci_rel.
inline double median_ci_rel(std::vector<double> v) {
  const size_t n = v.size();
  if (n < 3) return INFINITY;
  std::sort(v.begin(), v.end());
  const double half = 1.96 * std::sqrt(double(n));
  const long lo = std::max(long(std::floor((n - half) / 2)) - 1, 0L);
  const long hi = std::min(long(std::ceil(1 + (n + half) / 2)) - 1, long(n) - 1);
  const double med = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  return med > 0 ? (v[hi] - v[lo]) / (2 * med) : INFINITY;
}

inline void synchronize(const Args& a, Rung& r) { if (a.on_gpu()) LADDER_CUDA(cudaStreamSynchronize(r.stream())); }

// This process's own peak resident memory: VmHWM of /proc/self/status, which exec resets. Not getrusage's
// ru_maxrss, which carries the ladder parent's peak across fork and exec. -1 where there is no /proc (absent).
// harness/child/worker.py peak_rss_bytes does the same.
inline long long peak_rss_bytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) * 1024;  // "VmHWM:   123456 kB"
  return -1;
}

// The loss of the last training step (the rung's fp32 output), synchronised.
inline float last_loss(const Args& a, Rung& r) {
  float loss = 0;
  if (a.on_gpu()) {
    LADDER_CUDA(cudaStreamSynchronize(r.stream()));
    LADDER_CUDA(cudaMemcpy(&loss, r.device_output(), sizeof loss, cudaMemcpyDeviceToHost));
  } else {
    std::memcpy(&loss, r.device_output(), sizeof loss);
  }
  return loss;
}

// --train-data FILE: x [N, 3, H, W] fp32, y [N] class indices, order [epochs, steps x batch] indices into x (both
// as fp32, exact below 2^24), lr [epochs, steps] each step's learning rate. Each epoch runs its steps over its
// batches in order, each at its rate, then writes the state after it to --states DIR/epoch-E.safetensors; the result
// holds each epoch's wall time and mean loss (harness/accuracy.py).
inline int train_on_data(const Args& a, Rung& rung, Json& result) {
  phase("train");
  const TensorMap data = read_safetensors(a.get("train-data"));
  const HostTensor &x = data.at("x"), &y = data.at("y"), &order = data.at("order"), &lr = data.at("lr");
  const int64_t batch = a.i("batch"), image = x.shape[1] * x.shape[2] * x.shape[3];
  const int64_t epochs = order.shape[0], per_epoch = order.shape[1], steps = per_epoch / batch;
  if (lr.shape != std::vector<int64_t>{epochs, steps})
    throw std::runtime_error("--train-data: lr has shape " + shape_str(lr.shape) + ", expected [epochs, steps] = [" +
                             std::to_string(epochs) + ", " + std::to_string(steps) + "]");
  HostTensor xb{{batch, x.shape[1], x.shape[2], x.shape[3]}, std::vector<float>(batch * image)};
  std::vector<int> labels(batch);
  Json curve = Json::array();
  for (int64_t e = 0; e < epochs; ++e) {
    const double t = now_s();
    double loss_sum = 0;
    for (int64_t s = 0; s < steps; ++s) {
      for (int64_t i = 0; i < batch; ++i) {
        const int64_t idx = static_cast<int64_t>(order.data[e * per_epoch + s * batch + i]);
        std::copy_n(x.data.begin() + idx * image, image, xb.data.begin() + i * image);
        labels[i] = static_cast<int>(y.data[idx]);
      }
      rung.set_batch(xb, labels);
      rung.set_learning_rate(lr.data[e * steps + s]);
      rung.forward();
      loss_sum += last_loss(a, rung);
    }
    Json epoch = Json::object();
    epoch["epoch"] = static_cast<int>(e + 1);
    epoch["seconds"] = now_s() - t;
    epoch["train_loss"] = steps ? loss_sum / steps : 0.0;
    curve.push_back(epoch);
    write_safetensors(a.get("states") + "/epoch-" + std::to_string(e + 1) + ".safetensors", rung.state());
  }
  result["epochs"] = curve;
  phase("done");
  std::ofstream(a.get("result")) << result.dump() << "\n";
  return 0;
}

inline int run_child_impl(const Args& a, const RungFactory& factory) {
  Json result = Json::object();
  Json cold = Json::object();
  const bool gpu = a.on_gpu();

  phase("load");
  double t = now_s();
  TensorMap weights = read_safetensors(a.get("weights"));
  HostTensor input = read_safetensors(a.get("input")).at("input");
  cold["load_s"] = now_s() - t;

  phase("build");
  t = now_s();
  Json build_stats = Json::object();
  std::unique_ptr<Rung> rung = factory(a, weights, input, build_stats);
  cold["build_s"] = now_s() - t;
  weights.clear();
  if (a.kv.count("train-data")) {
    result["cold"] = cold;
    result["build_stats"] = build_stats;
    return train_on_data(a, *rung, result);
  }

  phase("first");
  t = now_s();
  rung->forward();
  synchronize(a, *rung);
  cold["first_result_s"] = now_s() - t;
  // Training: the parity steps go on from the first (harness/child/worker.py build does the same).
  for (int i = 1; i < std::stoi(a.get("parity-steps", "1")); ++i) rung->forward();
  write_safetensors(a.get("output"), rung->result_tensors());
  // The first logits, to hold a later call's against (`repeatable`); a training step's state moves on, so none.
  const bool training = a.get("task", "infer") == "train";
  const HostTensor first = training ? HostTensor{} : rung->output_fp32();
  result["cold"] = cold;
  result["build_stats"] = build_stats;
  result["stream"] = rung->stream_description();

  RegionTimer timer(gpu, rung->stream());
  auto timed_call = [&](double* host_us) {
    timer.start();
    double c0 = thread_cpu_us();
    rung->forward();
    if (host_us) *host_us = thread_cpu_us() - c0;
    timer.stop();
    return timer.elapsed_ms();
  };

  phase("warmup");
  std::vector<double> w;
  bool stable = false;
  t = now_s();
  while ((int)w.size() < a.i("warmup-max") && (now_s() - t < a.d("warmup-s") || (int)w.size() < a.i("warmup-min"))) {
    w.push_back(timed_call(nullptr));
    if ((int)w.size() >= std::max(a.i("warmup-min"), 6)) {  // second half's median within 2% of the first's
      const auto mid = w.begin() + w.size() / 2;
      double last = median_of({mid, w.end()}), prev = median_of({w.begin(), mid});
      if (std::abs(last - prev) <= 0.02 * prev) { stable = true; break; }
    }
  }
  Json warm = Json::object();
  warm["iters"] = (int)w.size();
  warm["stable"] = stable;
  result["warmup"] = warm;

  phase("latency");
  // Until the median is known to +-precision (95% CI), after --iters calls and --min-time-s; at most --max-time-s
  // or --max-iters (harness/child/worker.py latency_pass).
  std::vector<double> lat, host;
  std::string stopped;
  t = now_s();
  while (stopped.empty()) {
    double h = 0;
    lat.push_back(timed_call(&h));
    host.push_back(h);
    const double elapsed = now_s() - t;
    if ((int)lat.size() >= a.i("max-iters")) stopped = "iters";
    else if ((int)lat.size() >= a.i("iters") && elapsed >= a.d("min-time-s")) {
      if (median_ci_rel(lat) <= a.d("precision")) stopped = "precision";
      else if (elapsed >= a.d("max-time-s")) stopped = "time";
    }
  }
  Json latency = Json::object(); latency["samples_ms"] = Json(lat); latency["stopped"] = stopped;
  result["latency"] = latency;
  Json hostj = Json::object(); hostj["samples_us"] = Json(host); result["host"] = hostj;

  phase("pipelined");
  // At least --pipelined-iters forwards, and enough to last --pipelined-s at the measured latency.
  int n = std::max(a.i("pipelined-iters"), (int)std::ceil(a.d("pipelined-s") * 1e3 / median_of(lat)));
  timer.start();
  for (int i = 0; i < n; ++i) rung->forward();
  timer.stop();
  Json pipe = Json::object();
  pipe["iters"] = n;
  pipe["total_ms"] = timer.elapsed_ms();
  result["pipelined"] = pipe;

  phase("e2e");
  Json e2e = Json::object();
  std::vector<double> dev, pageable, pinned;
  if (gpu) {
    cudaStream_t s = rung->stream();
    std::vector<char> host_in(rung->input_bytes()), host_out(rung->output_bytes());
    LADDER_CUDA(cudaMemcpy(host_in.data(), rung->device_input(), host_in.size(), cudaMemcpyDeviceToHost));
    void *pin_in = nullptr, *pin_out = nullptr;
    LADDER_CUDA(cudaMallocHost(&pin_in, host_in.size()));
    LADDER_CUDA(cudaMallocHost(&pin_out, host_out.size()));
    std::memcpy(pin_in, host_in.data(), host_in.size());
    auto run = [&](void* in, void* out, bool copy_in) {
      double t0 = now_s();
      if (copy_in) LADDER_CUDA(cudaMemcpyAsync(rung->device_input(), in, host_in.size(), cudaMemcpyHostToDevice, s));
      rung->forward();
      LADDER_CUDA(cudaMemcpyAsync(out, rung->device_output(), host_out.size(), cudaMemcpyDeviceToHost, s));
      LADDER_CUDA(cudaStreamSynchronize(s));
      return (now_s() - t0) * 1e3;
    };
    for (int i = 0; i < a.i("e2e-iters"); ++i) {  // device: output to pinned memory, as harness/child/worker.py
      dev.push_back(run(nullptr, pin_out, false));
      pageable.push_back(run(host_in.data(), host_out.data(), true));
      pinned.push_back(run(pin_in, pin_out, true));
    }
    cudaFreeHost(pin_in);
    cudaFreeHost(pin_out);
  }
  e2e["device_ms"] = Json(dev); e2e["pageable_ms"] = Json(pageable); e2e["pinned_ms"] = Json(pinned);
  result["e2e"] = e2e;

  phase("memory");
  rung->reset_memory_peak();
  for (int i = 0; i < 3; ++i) rung->forward();
  synchronize(a, *rung);
  Json memory = Json::object();
  memory["allocator_peak_bytes"] = nullptr;
  memory["allocator_reserved_peak_bytes"] = nullptr;
  rung->report_memory(memory);
  result["memory"] = memory;

  phase("util");  // marks: [seconds since the pass began, calls done] about every UTIL_MARK_S (harness/child/contract.py)
  int iters = 0;
  Json marks = Json::array();
  marks.push_back(Json(std::vector<double>{0.0, 0.0}));
  double elapsed = 0, marked = 0;
  t = now_s();
  while ((elapsed = now_s() - t) < a.d("util-s")) {
    for (int i = 0; i < 4; ++i, ++iters) rung->forward();
    synchronize(a, *rung);
    if (now_s() - t - marked >= 0.25) {
      marked = now_s() - t;
      marks.push_back(Json(std::vector<double>{marked, double(iters)}));
    }
  }
  if (marked < elapsed) marks.push_back(Json(std::vector<double>{elapsed, double(iters)}));
  Json util = Json::object(); util["iters"] = iters; util["seconds"] = elapsed; util["marks"] = marks;
  result["util"] = util;

  if (std::stoi(a.get("census-steps", "0")) > 0) {  // after every timed phase: the profiler times nothing measured
    phase("census");
    result["census"] = rung->census(a.i("census-steps"), a.get("census"));
  }

  phase("after");  // the Python worker's rung facts; a C++ rung reports its facts in build_stats at build
  if (training) {
    result["repeatable"] = Json();
  } else {  // bit for bit, as harness/child/worker.py repeatable
    rung->forward();
    const HostTensor again = rung->output_fp32();
    result["repeatable"] = again.data.size() == first.data.size() &&
                           std::memcmp(again.data.data(), first.data.data(), first.data.size() * sizeof(float)) == 0;
  }
  phase("done");
  long long rss = peak_rss_bytes();
  if (rss >= 0) result["rss_peak_bytes"] = rss; else result["rss_peak_bytes"] = Json();
  std::ofstream(a.get("result")) << result.dump() << "\n";
  return 0;
}

// One cell's contract: its result file, or an `@@error` line with the exception's words.
inline bool run_one(const std::vector<std::string>& argv, const RungFactory& factory) {
  try {
    return run_child_impl(Args::parse(argv), factory) == 0;
  } catch (const std::exception& e) {
    std::string msg = e.what();
    std::replace(msg.begin(), msg.end(), '\n', ' ');
    std::cout << "@@error " << msg << std::endl;
    return false;
  }
}

// `--cells FILE`: a JSON list of single-cell command lines, measured in turn in this process, each announced with
// `@@cell I`; a failing cell reports `@@error` and the next one runs (harness/child/worker.py main does the same).
// Otherwise the command line is one cell's.
inline int run_child(int argc, char** argv, const RungFactory& factory) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  if (args.size() != 2 || args[0] != "--cells") return run_one(args, factory) ? 0 : 1;
  std::vector<std::vector<std::string>> jobs;
  try {
    std::ifstream f(args[1]);
    if (!f) throw std::runtime_error("cannot open " + args[1]);
    const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    for (const Json& job : Json::parse(text).arr) {
      jobs.emplace_back();
      for (const Json& word : job.arr) jobs.back().push_back(word.str);
    }
  } catch (const std::exception& e) {
    std::cout << "@@error --cells " << args[1] << ": " << e.what() << std::endl;
    return 1;
  }
  bool ok = true;
  for (size_t i = 0; i < jobs.size(); ++i) {
    std::cout << "@@cell " << i << std::endl;
    ok &= run_one(jobs[i], factory);
  }
  return ok ? 0 : 1;
}

}  // namespace ladder
