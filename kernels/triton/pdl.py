"""Programmatic dependent launch (Hopper and later): the next kernel launches before this one has finished.

At batch 1 a ResNet-50 forward is 57 short kernels in a row, and between two of them the GPU idles while the next
one launches and its programs start (about a microsecond each time, even inside a CUDA graph). A kernel launched
as a programmatic dependent launch (`launch_pdl=True`) may start while the kernel before it in the stream is still
running, once that kernel's programs have all signalled `gdc_launch_dependents` (or ended). Its own programs then
wait in `gdc_wait` until the kernel before has ended and its writes are visible. Every load and store comes after
the wait, which keeps the chain's order of reads and writes exactly as without it (read-after-write and
write-after-read alike). What may come before it is a prefetch of what no kernel writes: the convolution's weights
(`prefetch_l2`). At batch 1 each convolution streams its slice of the weights from HBM, a round trip of about a
microsecond before its first tile multiplies; prefetched while the kernel before still runs, they wait in L2.

Every kernel of the network calls `wait_for_prior_kernel` first; with GDC off (the interpreter, which has no such
instructions, or an older GPU) it compiles to nothing. https://docs.nvidia.com/cuda/cuda-c-programming-guide/
index.html#programmatic-dependent-launch-and-synchronization
"""
import triton
import triton.language as tl


@triton.jit
def wait_for_prior_kernel(GDC: tl.constexpr):
    """Wait until the kernel before in the stream has ended, then let the next one launch."""
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Start bringing the 128-byte lines holding `ptrs` into L2: no register is written and nothing waits for them,
    so the loads that follow hit L2 instead of HBM. Inline PTX, since Triton has no prefetch; GPU only."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)
