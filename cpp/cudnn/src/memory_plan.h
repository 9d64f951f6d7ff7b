// One memory plan for a sequence of steps on one stream, made offline since every lifetime is known up front: each
// tensor lives from the step that first writes it to the last step that reads it, and takes an offset in one
// allocation where no tensor alive at the same time lies. Largest first, each at the lowest gap that fits among the
// tensors it overlaps in time (greedy by size, the usual static planner); this lands close to the most bytes alive at
// once, which no plan can go below. A step's outputs never share with its inputs, so no kernel reads what it
// overwrites, except where the step says that it works in place (each element read before it is written, by the
// same thread) and the input dies there: then the two are one block.
#pragma once
#include <algorithm>
#include <cstddef>
#include <numeric>
#include <utility>
#include <vector>

namespace rung {

struct MemoryPlan {
  std::vector<long long> offsets;  // per tensor, into one allocation; -1 for a tensor the plan does not hold
  size_t total = 0;
  size_t peak_live = 0;            // the most bytes alive at once: what no plan of these steps can go below
};

struct PlannedStep {
  std::vector<int> reads, writes;                 // tensor indices
  std::vector<std::pair<int, int>> in_place = {};  // (output, input) pairs the step may compute in place
};

// bytes[t] == 0: tensor t lives elsewhere (the input, a parameter) and takes no memory here.
inline MemoryPlan plan_memory(const std::vector<size_t>& bytes, const std::vector<PlannedStep>& steps) {
  const int n = int(bytes.size());
  std::vector<int> first(n, -1), last(n, -1);
  for (int i = 0; i < int(steps.size()); ++i) {
    for (int w : steps[i].writes) {
      if (first[w] < 0) first[w] = i;
      last[w] = std::max(last[w], i);
    }
    for (int r : steps[i].reads) last[r] = i;
  }
  // In place: the output joins its input's block when the input dies at that step.
  std::vector<int> block(n);
  std::iota(block.begin(), block.end(), 0);
  for (int i = 0; i < int(steps.size()); ++i)
    for (const auto& [out, in] : steps[i].in_place)
      if (bytes[in] && last[in] == i && first[out] == i && bytes[in] >= bytes[out]) block[out] = block[in];
  std::vector<size_t> size(n, 0);
  std::vector<int> start(n, -1), end(n, -1);
  for (int t = 0; t < n; ++t) {
    if (!bytes[t] || first[t] < 0) continue;
    const int b = block[t];
    size[b] = std::max(size[b], bytes[t]);
    start[b] = start[b] < 0 ? first[t] : std::min(start[b], first[t]);
    end[b] = std::max(end[b], last[t]);
  }
  std::vector<int> order;
  for (int b = 0; b < n; ++b)
    if (size[b]) order.push_back(b);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return size[a] > size[b]; });
  MemoryPlan plan;
  std::vector<long long> at(n, -1);
  std::vector<int> placed;
  for (int b : order) {
    std::vector<std::pair<size_t, size_t>> taken;  // [offset, offset + size) of blocks alive with b
    for (int o : placed)
      if (start[o] <= end[b] && start[b] <= end[o]) taken.push_back({size_t(at[o]), size_t(at[o]) + size[o]});
    std::sort(taken.begin(), taken.end());
    size_t offset = 0, best = SIZE_MAX, best_gap = SIZE_MAX;
    for (const auto& [lo, hi] : taken) {
      if (lo >= offset && lo - offset >= size[b] && lo - offset < best_gap) best = offset, best_gap = lo - offset;
      offset = std::max(offset, hi);
    }
    at[b] = static_cast<long long>(best != SIZE_MAX ? best : offset);
    plan.total = std::max(plan.total, size_t(at[b]) + size[b]);
    placed.push_back(b);
  }
  plan.offsets.assign(n, -1);
  for (int t = 0; t < n; ++t)
    if (bytes[t] && first[t] >= 0) plan.offsets[t] = at[block[t]];
  for (int i = 0; i < int(steps.size()); ++i) {
    size_t live = 0;
    for (int b : order)
      if (start[b] <= i && i <= end[b]) live += size[b];
    plan.peak_live = std::max(plan.peak_live, live);
  }
  return plan;
}

}  // namespace rung
