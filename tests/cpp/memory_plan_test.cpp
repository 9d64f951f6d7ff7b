// Checks cpp/cudnn/src/memory_plan.h on random step sequences: no two tensors alive at one step share a byte (but
// an in-place pair, which must share), the plan never goes below the most bytes alive at once, and stays near it.
// Prints "ok <worst total / peak_live>"; anything else is a failure (tests/test_cudnn.py builds and runs it).
#include <cstdio>
#include <random>

#include "memory_plan.h"

int main() {
  std::mt19937 rng(7);
  double worst = 1.0;
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<size_t> bytes = {0};  // tensor 0: the input, held elsewhere
    std::vector<rung::PlannedStep> steps;
    std::vector<int> live = {0};
    for (int i = 0; i < 60; ++i) {
      rung::PlannedStep s;
      const int reads = 1 + int(rng() % 2);
      for (int r = 0; r < reads && !live.empty(); ++r) s.reads.push_back(live[rng() % live.size()]);
      const int out = int(bytes.size());
      bytes.push_back(256 * (1 + rng() % 64));
      s.writes.push_back(out);
      // In place over a read tensor that no later step reads, of at least the output's size.
      const int in = s.reads[0];
      if (in != 0 && rng() % 2 && bytes[in] >= bytes[out]) {
        s.in_place.push_back({out, in});
        live.erase(std::remove(live.begin(), live.end(), in), live.end());
      }
      live.push_back(out);
      if (live.size() > 6) live.erase(live.begin() + long(rng() % live.size()));  // dies: no later reads
      steps.push_back(s);
    }
    // Lifetimes as the planner sees them.
    const int n = int(bytes.size());
    std::vector<int> first(n, -1), last(n, -1);
    for (int i = 0; i < int(steps.size()); ++i) {
      for (int w : steps[i].writes) { if (first[w] < 0) first[w] = i; last[w] = std::max(last[w], i); }
      for (int r : steps[i].reads) last[r] = i;
    }
    const rung::MemoryPlan plan = rung::plan_memory(bytes, steps);
    auto shares = [&](int a, int b) {
      for (const auto& s : steps)
        for (const auto& [o, in] : s.in_place)
          if ((o == a && in == b) || (o == b && in == a)) return true;
      return false;
    };
    for (int a = 1; a < n; ++a) {
      if (plan.offsets[a] < 0 || size_t(plan.offsets[a]) + bytes[a] > plan.total) {
        std::puts("out of range");
        return 1;
      }
      for (int b = a + 1; b < n; ++b) {
        const bool together = first[a] <= last[b] && first[b] <= last[a];
        const bool overlap = plan.offsets[a] < plan.offsets[b] + (long long)bytes[b] &&
                             plan.offsets[b] < plan.offsets[a] + (long long)bytes[a];
        if (shares(a, b)) {
          if (plan.offsets[a] != plan.offsets[b]) { std::puts("in-place pair not shared"); return 1; }
        } else if (together && overlap) {
          std::printf("tensors %d and %d alive together share bytes\n", a, b);
          return 1;
        }
      }
    }
    if (plan.total < plan.peak_live) { std::puts("below the lower bound"); return 1; }
    worst = std::max(worst, double(plan.total) / plan.peak_live);
  }
  if (worst > 1.5) { std::printf("far from the lower bound: %.2f\n", worst); return 1; }
  std::printf("ok %.3f\n", worst);
  return 0;
}
