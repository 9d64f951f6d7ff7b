#include "census.h"

#ifdef LADDER_CUPTI
#include <cupti.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <stdexcept>

namespace rung {
namespace {

#define CUPTI_CHECK(call)                                                                     \
  do {                                                                                        \
    CUptiResult r_ = (call);                                                                  \
    if (r_ != CUPTI_SUCCESS) {                                                                \
      const char* s_ = nullptr;                                                               \
      cuptiGetResultString(r_, &s_);                                                          \
      throw std::runtime_error(std::string(#call) + ": " + (s_ ? s_ : "CUPTI error"));         \
    }                                                                                         \
  } while (0)

// What the buffers delivered, in the trace's terms (µs come later, from a common origin).
struct Record {
  std::string cat, name;
  unsigned long long start, end;
  unsigned correlation, stream;
  ladder::Json args;
};
std::mutex records_mutex;
std::vector<Record> records;

constexpr CUpti_ActivityKind kKinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
                                         CUPTI_ACTIVITY_KIND_MEMSET, CUPTI_ACTIVITY_KIND_RUNTIME,
                                         CUPTI_ACTIVITY_KIND_DRIVER};

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *size = 8u << 20;
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, *size));
  *max_records = 0;  // as many as fit
}

ladder::Json dims(int x, int y, int z) {
  ladder::Json j = ladder::Json::array();
  j.push_back(x), j.push_back(y), j.push_back(z);
  return j;
}

// Records are read through the oldest layout that CUDA 13.0 and later share (Kernel10: later versions append).
void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  std::lock_guard<std::mutex> lock(records_mutex);
  CUpti_Activity* a = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &a) == CUPTI_SUCCESS) {
    switch (a->kind) {
      case CUPTI_ACTIVITY_KIND_KERNEL:
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
        auto* k = reinterpret_cast<CUpti_ActivityKernel10*>(a);
        ladder::Json args = ladder::Json::object();
        args["grid"] = dims(k->gridX, k->gridY, k->gridZ);
        args["block"] = dims(k->blockX, k->blockY, k->blockZ);
        records.push_back({"kernel", k->name ? k->name : "?", k->start, k->end, k->correlationId, k->streamId, args});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        auto* m = reinterpret_cast<CUpti_ActivityMemcpy6*>(a);
        ladder::Json args = ladder::Json::object();
        args["bytes"] = static_cast<unsigned long long>(m->bytes);
        records.push_back({"gpu_memcpy", "Memcpy", m->start, m->end, m->correlationId, m->streamId, args});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        auto* m = reinterpret_cast<CUpti_ActivityMemset4*>(a);
        ladder::Json args = ladder::Json::object();
        args["bytes"] = static_cast<unsigned long long>(m->bytes);
        records.push_back({"gpu_memset", "Memset", m->start, m->end, m->correlationId, m->streamId, args});
        break;
      }
      case CUPTI_ACTIVITY_KIND_RUNTIME:
      case CUPTI_ACTIVITY_KIND_DRIVER: {
        auto* api = reinterpret_cast<CUpti_ActivityAPI*>(a);
        const bool runtime = a->kind == CUPTI_ACTIVITY_KIND_RUNTIME;
        const char* name = nullptr;
        cuptiGetCallbackName(runtime ? CUPTI_CB_DOMAIN_RUNTIME_API : CUPTI_CB_DOMAIN_DRIVER_API, api->cbid, &name);
        records.push_back({runtime ? "cuda_runtime" : "cuda_driver", name ? name : "?", api->start, api->end,
                           api->correlationId, 0, ladder::Json::object()});
        break;
      }
      default: break;
    }
  }
  std::free(buffer);
}

}  // namespace

CuptiTrace::CuptiTrace() {
  {
    std::lock_guard<std::mutex> lock(records_mutex);
    records.clear();
  }
  static const bool registered = [] {  // once per process: a child measuring several cells traces each
    CUPTI_CHECK(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed));
    return true;
  }();
  (void)registered;
  for (CUpti_ActivityKind k : kKinds) CUPTI_CHECK(cuptiActivityEnable(k));
}

CuptiTrace::~CuptiTrace() {
  for (CUpti_ActivityKind k : kKinds) cuptiActivityDisable(k);
}

unsigned long long CuptiTrace::now() {
  uint64_t t = 0;
  CUPTI_CHECK(cuptiGetTimestamp(&t));
  return t;
}

void CuptiTrace::range(const std::string& name, unsigned long long start, unsigned long long end, ladder::Json args) {
  ranges_.push_back({name, start, end, std::move(args)});
}

void CuptiTrace::write(const std::string& path) {
  CUPTI_CHECK(cuptiActivityFlushAll(1));
  std::lock_guard<std::mutex> lock(records_mutex);
  unsigned long long origin = ~0ull;
  for (const Range& r : ranges_) origin = std::min(origin, r.start);
  for (const Record& r : records) origin = std::min(origin, r.start);
  auto us = [&](unsigned long long t) { return (static_cast<double>(t) - static_cast<double>(origin)) / 1e3; };
  // The rung launches from one thread: its ranges and its API calls share one host thread (pid 1, tid 1); each
  // stream is a device thread (pid 0).
  ladder::Json events = ladder::Json::array();
  auto event = [&](const std::string& cat, const std::string& name, int pid, unsigned tid, unsigned long long start,
                   unsigned long long end, ladder::Json args) {
    ladder::Json e = ladder::Json::object();
    e["ph"] = "X";
    e["cat"] = cat;
    e["name"] = name;
    e["pid"] = pid;
    e["tid"] = static_cast<unsigned long long>(tid);
    e["ts"] = us(start);
    e["dur"] = static_cast<double>(end - start) / 1e3;
    e["args"] = std::move(args);
    events.push_back(std::move(e));
  };
  for (const Range& r : ranges_) event("user_annotation", r.name, 1, 1, r.start, r.end, r.args);
  for (const Record& r : records) {
    ladder::Json args = r.args;
    args["correlation"] = static_cast<unsigned long long>(r.correlation);
    const bool host = r.cat == "cuda_runtime" || r.cat == "cuda_driver";
    event(r.cat, r.name, host ? 1 : 0, host ? 1 : r.stream, r.start, r.end, args);
  }
  ladder::Json trace = ladder::Json::object();
  trace["traceEvents"] = events;
  std::ofstream(path) << trace.dump() << "\n";
}

}  // namespace rung
#endif
