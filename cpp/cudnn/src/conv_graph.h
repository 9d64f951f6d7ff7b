// The cuDNN graph of one convolution pass and its epilogue (conv.h's ConvSpec), what runs around it, and its
// variant pack: the pieces the engine search (engine_search.cpp) and a layer's run (conv_graph.cpp) share.
#pragma once
#include <string>
#include <vector>

#include "conv.h"

namespace rung {

// A cuDNN status that is not success as an exception naming `what`.
void check(cudnnStatus_t s, const std::string& what);

// The operation graph of the spec, with the epilogue (fused) or without it. Returns every descriptor it made; the
// operation graph is the last.
std::vector<Desc> build_graph(cudnnHandle_t handle, const ConvSpec& spec, bool fused);

// Before the graph: genstats' sums zeroed. After a convolution run alone: its epilogue by our kernel.
void before_graph(const ConvSpec& spec, bool fused, const ConvIO& io, cudaStream_t stream);
void after_graph(const ConvSpec& spec, bool fused, const ConvIO& io, cudaStream_t stream);

// The device pointers of the graph's tensors and the workspace, for one execution.
Desc variant_pack(const ConvSpec& spec, bool fused, const ConvIO& io, void* workspace);

}  // namespace rung
