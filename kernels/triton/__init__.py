"""Hand-written Triton kernels for ResNet over NHWC tensors: implicit-GEMM convolution with a fused epilogue
(conv.py), pooling (pool.py), the network built from them (resnet.py), and the shared autotuning (tuning.py)."""
