"""Compiles a Triton kernel's every autotuning configuration for Hopper (sm90) on a machine without a GPU: Triton's
front end, its passes and NVIDIA's ptxas, which the triton wheel ships. The interpreter, which runs the kernels in
CI, never compiles them, so a configuration that does not compile would first fail on the GPU.

    python -m tests.hopper_compile    # prints one line per configuration; exit 1 if one failed

Run without TRITON_INTERPRET (it replaces the compiler)."""
from __future__ import annotations

import sys
from types import SimpleNamespace

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

HOPPER = GPUTarget("cuda", 90, 32)


def compile_configs(kernel, pointers: dict[str, str], constants: dict[str, object]) -> list[str]:
    """Compiles `kernel` (a triton.autotune of a triton.jit) once per configuration: `pointers` the pointer
    arguments' types ('*bf16'), `constants` its other constexpr arguments; integers for the rest. Returns one line
    each: the configuration and its shared memory, or the error."""
    fn = kernel.fn
    lines = []
    for config in kernel.configs:
        values = {**constants, **config.kwargs}
        signature = {name: pointers.get(name) or ("constexpr" if name in values else "i32") for name in fn.arg_names}
        constexprs = {(fn.arg_names.index(name),): value for name, value in values.items()}
        try:
            compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=HOPPER,
                                      options={"num_warps": config.num_warps, "num_stages": config.num_stages})
            lines.append(f"ok {fn.__name__} {config} {constants}: {compiled.metadata.shared} B shared")
        except Exception as e:  # every failure, whatever the compiler stage raised, is the check's finding
            lines.append(f"FAILED {fn.__name__} {config} {constants}: {type(e).__name__}: {str(e)[:400]}")
    return lines


def compile_once(kernel, types: dict[str, str], constants: dict[str, object]) -> list[str]:
    """compile_configs for a kernel that is not autotuned: its one launch configuration (four warps)."""
    return compile_configs(SimpleNamespace(fn=kernel, configs=[triton.Config({}, num_warps=4, num_stages=3)]), types,
                           constants)


def some_configs(kernel, picked: slice):
    """`kernel` (a triton.autotune) with the `picked` slice of its configurations only (the largest tiles, which
    need the most registers: the convolution's first, the weight gradient's last)."""
    return SimpleNamespace(fn=kernel.fn, configs=kernel.configs[picked])


def main() -> int:
    from kernels.triton.batch_norm import (BLOCK_C, BLOCK_S, _channel_affine_kernel, _grad_finalize_kernel,
                                           _grad_sums_kernel, _merge_slices_kernel, _moments_finalize_kernel,
                                           _moments_kernel)
    from kernels.triton.conv_backward import SUM_BLOCK, _sum_slices_kernel, conv2d_weight_grad_kernel

    lines = []
    bf16 = {name: "*bf16" for name in ("x_ptr", "dy_ptr", "y_ptr")}  # bf16: the GPU's training dtype
    wgrad = {**bf16, "dw_ptr": "*fp32", "norm_ptr": "*fp32"}
    for kw, taps_in_tile in ((3, False), (7, True)):  # a 3x3 by taps; the stem's 7x7 over its 3 channels
        lines += compile_configs(conv2d_weight_grad_kernel, wgrad,
                                 {"KW": kw, "TAPS_IN_TILE": taps_in_tile, "PRECISION": "ieee", "NORM": False})
    # the norm prologue's (the activation recomputed from the batch norm's input, as the training micro times it)
    lines += compile_configs(some_configs(conv2d_weight_grad_kernel, slice(-3, None)), wgrad,
                             {"KW": 3, "TAPS_IN_TILE": False, "PRECISION": "ieee", "NORM": True})
    lines += compile_once(_sum_slices_kernel, {"part_ptr": "*fp32", "dw_ptr": "*fp32"},
                          {"BLOCK_S": 16, "BLOCK_N": SUM_BLOCK})
    sums = ("mean_ptr", "m2_ptr", "invstd_ptr", "sum_dy_ptr", "sum_dy_xhat_ptr")
    pointers = {**bf16, **{name: "*fp32" for name in sums}}
    lines += compile_configs(_moments_kernel, pointers, {"BLOCK_C": BLOCK_C})
    lines += compile_configs(_grad_sums_kernel, pointers, {"BLOCK_C": BLOCK_C, "RELU": True})
    fp32 = {name: "*fp32" for name in _moments_finalize_kernel.arg_names + _grad_finalize_kernel.arg_names
            if name.endswith("_ptr")}
    lines += compile_once(_moments_finalize_kernel, {**fp32, "batches_ptr": "*i64", "eps": "fp32", "momentum": "fp32"},
                          {"AFFINE": True, "RUNNING": True, "BLOCK_C": BLOCK_C, "BLOCK_S": BLOCK_S})
    lines += compile_once(_grad_finalize_kernel, fp32, {"BLOCK_C": BLOCK_C, "BLOCK_S": BLOCK_S})
    for moments in (True, False):
        lines += compile_once(_merge_slices_kernel, {name: "*fp32" for name in _merge_slices_kernel.arg_names
                                                     if name.endswith("_ptr")},
                              {"MOMENTS": moments, "BLOCK_C": BLOCK_C, "BLOCK_S": BLOCK_S})
    tiles = {name: "*bf16" for name in ("u_ptr", "v_ptr", "r_ptr", "gate_ptr", "out_ptr", "gated_ptr")}
    lines += compile_configs(_channel_affine_kernel, {**tiles, **{f"k{i}_ptr": "*fp32" for i in (1, 2, 3)}},
                             {"HAS_V": True, "HAS_R": False, "GATE": True, "KEEP_GATED": True, "RELU": False,
                              "BLOCK_C": BLOCK_C})
    # the convolution with the training step's epilogue statistics (kernels/triton/conv.py _tile_stats): the data
    # gradient's sums (the most registers: its largest tile reaches 255) in every configuration, the moments in the
    # three largest tiles
    from kernels.triton.conv import conv2d_nhwc_kernel
    conv = {**{name: "*bf16" for name in ("x_ptr", "w_ptr", "res_ptr", "y_ptr", "bn_x_ptr", "gate_ptr")},
            **{name: "*fp32" for name in ("bias_ptr", "scale_ptr", "part_ptr", "a_ptr", "b_ptr", "bn_mean_ptr",
                                          "bn_invstd_ptr")}, "count_ptr": "*i32", "a_inv": "fp32", "out_inv": "fp32"}
    fixed = {"KH": 3, "KW": 3, "STRIDE": 1, "PAD": 1, "RELU": False, "PRECISION": "ieee", "FP8": False,
             "W_KMAJOR": False, "SC_STRIDE": 0, "K_ALIGN": 128, "NORM": False}
    lines += compile_configs(conv2d_nhwc_kernel, conv, {**fixed, "HAS_RES": True, "STATS": "grad_sums"})
    lines += compile_configs(some_configs(conv2d_nhwc_kernel, slice(3)), conv,
                             {**fixed, "HAS_RES": False, "STATS": "moments"})
    # the norm prologue (the batch norm before it applied and ReLU'd on the load, as the training micro times it)
    lines += compile_configs(some_configs(conv2d_nhwc_kernel, slice(3)), conv,
                             {**fixed, "HAS_RES": False, "STATS": "moments", "NORM": True})
    # fp8 inference (tiers/triton.py FP8_RECIPE): e4m3 in, e4m3 residual and output; the pair chained into the next
    # block's conv1, its operand converted from the e4m3 tile it stores
    e4m3 = {**conv, **{name: "*fp8e4nv" for name in ("x_ptr", "w_ptr", "res_ptr", "y_ptr")}, "res_scale": "fp32"}
    lines += compile_configs(some_configs(conv2d_nhwc_kernel, slice(3)), e4m3,
                             {**fixed, "KH": 1, "KW": 1, "PAD": 0, "RELU": True, "FP8": True, "W_KMAJOR": True,
                              "HAS_RES": True, "STATS": "none"})
    from kernels.triton.pair import conv_pair_kernel
    pair = {**{name: "*fp8e4nv" for name in ("x_ptr", "w_ptr", "w2_ptr", "res_ptr", "y_ptr", "w3_ptr", "y3_ptr")},
            **{name: "*fp32" for name in ("bias_ptr", "bias2_ptr", "scale_ptr", "scale2_ptr", "bias3_ptr",
                                          "scale3_ptr")},
            **{name: "fp32" for name in ("a_inv", "mid_inv", "out2_inv", "res_scale", "a3_inv", "out3_inv")}}
    lines += compile_configs(some_configs(conv_pair_kernel, slice(2)), pair,
                             {"COUT": 64, "KH": 3, "KW": 3, "STRIDE": 1, "PAD": 1, "PRECISION": "ieee", "FP8": True,
                              "W_KMAJOR": True, "K_ALIGN": 64, "SC_STRIDE": 0, "C3": 64})
    print("\n".join(lines))
    return 1 if any(line.startswith("FAILED") for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
