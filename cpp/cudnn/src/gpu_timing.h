// GPU time of a piece of work: CUDA-event medians, and the same work captured as a CUDA graph and replayed.
#pragma once
#include <cuda_runtime.h>

#include <functional>
#include <stdexcept>
#include <vector>

#include "ladder/protocol.h"  // LADDER_CUDA, ladder::median_of

namespace rung {

// Median time of `reps` calls of fn on `stream`, each bracketed by CUDA events, after `warm` untimed calls.
inline double median_ms(cudaStream_t stream, const std::function<void()>& fn, int reps, int warm = 2) {
  for (int i = 0; i < warm; ++i) fn();
  cudaEvent_t a, b;
  LADDER_CUDA(cudaEventCreate(&a));
  LADDER_CUDA(cudaEventCreate(&b));
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    LADDER_CUDA(cudaEventRecord(a, stream));
    fn();
    LADDER_CUDA(cudaEventRecord(b, stream));
    LADDER_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    LADDER_CUDA(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ladder::median_of(t);
}

// fn's work on `stream` captured as one CUDA graph and instantiated; `nodes`, if given, gets the graph's node count.
// Throws if fn does something a capture does not allow; the stream leaves capture mode either way.
inline cudaGraphExec_t capture_graph(cudaStream_t stream, const std::function<void()>& fn, size_t* nodes = nullptr) {
  cudaGraph_t graph = nullptr;
  LADDER_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  try {
    fn();
  } catch (...) {
    if (cudaStreamEndCapture(stream, &graph) == cudaSuccess && graph) cudaGraphDestroy(graph);
    throw;
  }
  LADDER_CUDA(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec = nullptr;
  const cudaError_t made = cudaGraphInstantiate(&exec, graph, 0);
  if (made == cudaSuccess && nodes) LADDER_CUDA(cudaGraphGetNodes(graph, nullptr, nodes));
  cudaGraphDestroy(graph);
  LADDER_CUDA(made);
  return exec;
}

// Median GPU time of one call of fn, from replays of a CUDA graph of `calls` calls back to back: no host time before
// or between them, as in a captured forward. (median_ms of one call counts the host's work before its first kernel
// starts: at batch 1 that is most of a convolution's 15 us, its kernel 4 us.) -1 if fn cannot be captured.
inline double graph_ms(cudaStream_t stream, const std::function<void()>& fn, int calls, int reps) {
  cudaGraphExec_t exec = nullptr;
  try {
    exec = capture_graph(stream, [&] {
      for (int i = 0; i < calls; ++i) fn();
    });
  } catch (const std::exception&) {
    (void)cudaGetLastError();  // the failed capture's error is not this process's
    return -1;
  }
  const double ms = median_ms(stream, [&] { LADDER_CUDA(cudaGraphLaunch(exec, stream)); }, reps, 1) / calls;
  cudaGraphExecDestroy(exec);
  return ms;
}

}  // namespace rung
