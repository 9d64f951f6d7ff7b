// One memory plan for a sequence of steps on one stream: each tensor a step writes takes a buffer whose previous
// tenant is dead (last read by an earlier step), the smallest that fits, else the largest free one grown; a new
// buffer only when none is free. A step's outputs never share with its inputs, so no kernel reads what it
// overwrites, except where the step says that it works in place (each element read before it is written, by the
// same thread) and the input dies there.
#pragma once
#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

namespace rung {

struct MemoryPlan {
  std::vector<long long> offsets;  // per tensor, into one allocation; -1 for a tensor the plan does not hold
  std::vector<size_t> buffers;     // each buffer's size
  size_t total = 0;
  size_t peak_live = 0;            // the most bytes alive at once: what no plan of these steps can go below
};

struct PlannedStep {
  std::vector<int> reads, writes;                 // tensor indices
  std::vector<std::pair<int, int>> in_place = {};  // (output, input) pairs the step may compute in place
};

// bytes[t] == 0: tensor t lives elsewhere (the input, a parameter) and takes no buffer.
inline MemoryPlan plan_memory(const std::vector<size_t>& bytes, const std::vector<PlannedStep>& steps) {
  std::vector<int> last_use(bytes.size(), -1);
  for (size_t i = 0; i < steps.size(); ++i) {
    for (int r : steps[i].reads) last_use[r] = int(i);
    for (int w : steps[i].writes) last_use[w] = std::max(last_use[w], int(i));
  }
  struct Buffer { size_t bytes = 0; int tenant = -1; };
  std::vector<Buffer> buffers;
  std::vector<int> home(bytes.size(), -1);
  for (size_t i = 0; i < steps.size(); ++i)
    for (int out : steps[i].writes) {
      if (bytes[out] == 0 || home[out] >= 0) continue;
      const size_t need = bytes[out];
      int pick = -1;
      for (const auto& [o, in] : steps[i].in_place)
        if (o == out && home[in] >= 0 && last_use[in] == int(i) && buffers[home[in]].bytes >= need) pick = home[in];
      if (pick >= 0) {
        buffers[pick].tenant = out;
        home[out] = pick;
        continue;
      }
      for (int j = 0; j < int(buffers.size()); ++j) {
        if (buffers[j].tenant >= 0 && last_use[buffers[j].tenant] >= int(i)) continue;  // still live
        if (pick < 0) { pick = j; continue; }
        const bool fits = buffers[j].bytes >= need, pick_fits = buffers[pick].bytes >= need;
        if (fits ? (!pick_fits || buffers[j].bytes < buffers[pick].bytes)
                 : (!pick_fits && buffers[j].bytes > buffers[pick].bytes))
          pick = j;
      }
      if (pick < 0) {
        buffers.emplace_back();
        pick = int(buffers.size()) - 1;
      }
      buffers[pick].bytes = std::max(buffers[pick].bytes, need);
      buffers[pick].tenant = out;
      home[out] = pick;
    }
  MemoryPlan plan;
  std::vector<int> first_write(bytes.size(), -1);
  for (size_t i = 0; i < steps.size(); ++i)
    for (int w : steps[i].writes)
      if (first_write[w] < 0) first_write[w] = int(i);
  for (size_t i = 0; i < steps.size(); ++i) {
    size_t live = 0;
    for (size_t t = 0; t < bytes.size(); ++t)
      if (first_write[t] >= 0 && first_write[t] <= int(i) && last_use[t] >= int(i)) live += bytes[t];
    plan.peak_live = std::max(plan.peak_live, live);
  }
  std::vector<size_t> base;
  for (const Buffer& b : buffers) {
    base.push_back(plan.total);
    plan.total += b.bytes;
    plan.buffers.push_back(b.bytes);
  }
  plan.offsets.assign(bytes.size(), -1);
  for (size_t t = 0; t < bytes.size(); ++t)
    if (home[t] >= 0) plan.offsets[t] = static_cast<long long>(base[home[t]]);
  return plan;
}

}  // namespace rung
