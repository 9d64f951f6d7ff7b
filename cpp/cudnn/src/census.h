// The census pass of the cudnn rung (ladder::Rung::census): CUPTI's activity API records every kernel, copy and
// memset and the runtime and driver calls that launched them; the rung adds its own host ranges (the census step,
// and each step of its schedule with the layer it computes). Written as a Chrome trace in the subset of Kineto's
// format that harness/run/census.py reads, so that the cudnn rung's census means what torch.profiler's does.
#pragma once
#include <string>
#include <vector>

#include <ladder/json.h>

namespace rung {

#ifdef LADDER_CUPTI
class CuptiTrace {
 public:
  CuptiTrace();   // enables the activity kinds; one trace at a time in a process
  ~CuptiTrace();  // disables them
  CuptiTrace(const CuptiTrace&) = delete;
  CuptiTrace& operator=(const CuptiTrace&) = delete;

  static unsigned long long now();  // CUPTI's clock (ns), that of its records
  // A host range of the launching thread: `args` may name its layer (harness/run/census.py LAYER, BASIS, PHASE).
  void range(const std::string& name, unsigned long long start, unsigned long long end, ladder::Json args);
  void write(const std::string& path);  // flushes CUPTI's buffers, then the trace (ts in µs from the first range)

 private:
  struct Range {
    std::string name;
    unsigned long long start, end;
    ladder::Json args;
  };
  std::vector<Range> ranges_;
};
#endif

}  // namespace rung
