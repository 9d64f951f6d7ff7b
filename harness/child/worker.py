"""The child process of a Python rung: docs/protocol.md, phase by phase, for one cell or for a list of cells of one
rung measured in turn (the runner's `--isolation rung`).

cpp/common/ladder/protocol.h is the same protocol for the C++ rungs; keep the two in step.
Run as `python -m harness.child.worker --tier NAME --batch ... --result R.json ...` or
`python -m harness.child.worker --cells FILE` (the runner builds both)."""
from __future__ import annotations

import gc
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file

from core import train
from core.cell import Built, Cell, Store
from core.files import write_text_atomic
from core.memory import proc_bytes
from core.model import load_model, read_tensor
from core.parity import run_stages, stage_errors, unpack_stages
from core.placement import set_math_mode
from core.stats import median
from harness.child import profile
from harness.child.contract import CELL, ERROR, PHASE, UTIL_MARK_S, cell_of, parse_argv
from harness.child.timing import Clock, latency_pass, prepare_input, stream_of, sync_of, timed_forward, warmup_pass
from tiers import get_tier


def phase(name: str) -> None:
    print(f"{PHASE}{name}", flush=True)


def capture_cuda_graph(built: Built, example: torch.Tensor) -> Built:
    """Wraps a rung's forward in a CUDA graph: warm up on a side stream (as torch requires), capture, replay.
    The graph reads the static `example` buffer, which is why the worker always passes that same tensor."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            built.forward(example)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = built.forward(example)

    def replay(_x: torch.Tensor) -> torch.Tensor:
        graph.replay()
        return static_out

    return Built(forward=replay, stream=None, stream_description="torch current stream (CUDA graph replay)",
                 stats={**built.stats, "cuda_graph": True}, uses_torch_allocator=built.uses_torch_allocator,
                 stages=built.stages)  # the same kernels, launched one stage at a time


def pipelined_iters(kv: dict[str, str], latency_ms: list[float]) -> int:
    """At least --pipelined-iters forwards, and enough to last --pipelined-s at the measured latency."""
    return max(int(kv["pipelined-iters"]), math.ceil(float(kv["pipelined-s"]) * 1e3 / median(latency_ms)))


def store_of(kv: dict[str, str]) -> Store:
    """The rung's cache and tunings, from the contract's --cache-dir and --tunings (as a C++ child reads them)."""
    return Store(cache=Path(kv["cache-dir"]) if kv.get("cache-dir") else None,
                 tunings=Path(kv["tunings"]) if kv.get("tunings") else None,
                 calibration=Path(kv["calibration"]) if kv.get("calibration") else None)


def build(kv: dict[str, str], cell: Cell, result: dict[str, Any], lr: float | torch.Tensor | None = None
          ) -> tuple[Any, Built, torch.Tensor, torch.Tensor]:
    """The load and build phases of a cell. Returns (tier, built, example, the input as read). `lr`: a training
    step's rate (default --lr), or a one-element tensor a schedule sets before each step."""
    tier = get_tier(cell.tier)
    store = store_of(kv)
    os.environ.update(store.library_env())  # read by Inductor and Triton when they first compile
    phase("load")
    t = time.perf_counter()
    model = load_model(cell.model, kv["weights"])
    x_host = read_tensor(kv["input"], "input")
    result["cold"]["load_s"] = time.perf_counter() - t

    phase("build")
    t = time.perf_counter()
    set_math_mode(cell.dtype)
    benchmark = tier.setting(cell, "cudnn-benchmark")  # tiers/base.py CUDNN_BENCHMARK; None: no cuDNN of PyTorch's
    torch.backends.cudnn.benchmark = benchmark == "on"
    example = prepare_input(x_host, cell)
    if cell.task == "train":
        built = tier.build_train(model.train(), example, cell, store, lr=float(kv["lr"]) if lr is None else lr)
    else:
        built = tier.build(model, example, cell, store)
    if benchmark is not None:
        built.stats["cudnn_benchmark"] = benchmark == "on"
    if cell.cuda_graph and not built.captured:
        built = capture_cuda_graph(built, example)
    result["cold"]["build_s"] = time.perf_counter() - t
    return tier, built, example, x_host


def first_result(kv: dict[str, str], cell: Cell, built: Built, example: torch.Tensor, x_host: torch.Tensor,
                 result: dict[str, Any]) -> torch.Tensor | None:
    """The cold part's last phase: the first result, written to --output (and a training cell's parity steps).
    Returns the logits on the host (a forward's), for `repeatable`."""
    phase("first")
    t = time.perf_counter()
    out = built.forward(example)
    sync_of(built, cell)()
    result["cold"]["first_result_s"] = time.perf_counter() - t
    if cell.task == "train":  # the parity steps: the first was the first result, from the run's weights
        # each step's own loss: a captured step returns its graph's loss buffer, which the next replay overwrites
        losses = [out.clone()] + [built.forward(example).clone() for _ in range(int(kv["parity-steps"]) - 1)]
        save_file(train.output_tensors(losses, built.state()), kv["output"])
    else:
        logits = out.detach().float().cpu().contiguous()
        save_file({"output": logits}, kv["output"])
        if kv.get("stages") and built.stages:  # the stage check (core/parity.py): errors only, the parent judges
            refs = unpack_stages(load_file(kv["stages"]))
            x = x_host[:refs[0][1].shape[0]].to(example.device)
            result["stage_errors"] = stage_errors(run_stages(built.stages(), x, refs), refs)
    # Keep no reference to this output: under reduce-overhead (CUDA-graph trees) a later call overwrites it.
    result["output"] = {"shape": list(out.shape), "dtype": out.dtype}
    return None if cell.task == "train" else logits


def logits_on_host(cell: Cell, built: Built, x: torch.Tensor) -> torch.Tensor:
    """One forward's logits, copied to the host in fp32 once the rung's own stream (ONNX Runtime's) is done: a
    copy, as a replay reuses its output."""
    out = built.forward(x)
    sync_of(built, cell)()
    return out.detach().float().cpu().contiguous()


def repeatable(cell: Cell, built: Built, example: torch.Tensor, first: torch.Tensor | None) -> bool | None:
    """Whether one more call on the same input gives the first call's logits bit for bit (a kernel that races or
    reads memory it does not own shows here); None for a training step, whose state moved on."""
    if first is None:
        return None
    again = logits_on_host(cell, built, example)
    return again.shape == first.shape and torch.equal(again.view(torch.int32), first.view(torch.int32))


def train_on_data(kv: dict[str, str], cell: Cell, result: dict[str, Any]) -> dict[str, Any]:
    """--train-data FILE and --states DIR (harness/child/contract.py TRAIN_PHASES), as the C++ rungs do it
    (cpp/common/ladder/protocol.h train_on_data): each epoch's steps over its batches of `order`, each at its rate
    of `lr`, then the state after the epoch to DIR/epoch-E.safetensors. The result: cold, build_stats, epochs."""
    data = load_file(kv["train-data"])
    x, y, order, rates = data["x"], data["y"].long(), data["order"].long(), data["lr"]
    rate = torch.tensor(rates[0, 0].item())  # on the host, as a schedule hands it over (core/train.py make_step)
    _, built, _, _ = build(kv, cell, result, lr=rate)
    phase("train")
    epochs = []
    for e, (batches, epoch_rates) in enumerate(zip(order.view(order.shape[0], -1, cell.batch), rates), start=1):
        t = time.perf_counter()
        losses = []
        for idx, r in zip(batches, epoch_rates.tolist()):
            rate.fill_(r)
            losses.append(built.forward(prepare_input(x[idx], cell), y[idx].to(cell.device)))
        loss = torch.stack(losses).float().mean().item()  # one sync per epoch
        epochs.append({"epoch": e, "seconds": time.perf_counter() - t, "train_loss": loss})
        save_file(built.state(), str(Path(kv["states"]) / f"epoch-{e}.safetensors"))
    phase("done")
    return {"cold": result["cold"], "build_stats": built.stats, "epochs": epochs}


def evaluate_on_data(kv: dict[str, str], cell: Cell, result: dict[str, Any]) -> dict[str, Any]:
    """--eval-data FILE (harness/child/contract.py EVAL_PHASES): the built forward over every image of `x`, a batch
    of the cell's size at a time (the last one filled up with the first images, whose logits are dropped), every
    image's logits to --output. The result: cold, build_stats, images."""
    x = load_file(kv["eval-data"])["x"]
    _, built, _, _ = build(kv, cell, result)
    phase("eval")
    logits = []
    for i in range(0, len(x), cell.batch):
        chunk = x[i:i + cell.batch]
        full = torch.cat([chunk, x[:cell.batch - len(chunk)]]) if len(chunk) < cell.batch else chunk
        logits.append(logits_on_host(cell, built, prepare_input(full, cell))[:len(chunk)])
    save_file({"output": torch.cat(logits).contiguous()}, kv["output"])
    phase("done")
    return {"cold": result["cold"], "build_stats": built.stats, "images": len(x)}


def end_to_end_pass(forward: Callable[[Any], Any], example: torch.Tensor, stream: Any, output: dict[str, Any],
                    iters: int) -> dict[str, list[float]]:
    """Input copy H2D (pageable, pinned, or none) + forward + output copy D2H, synchronised; empty on the CPU.
    device: the output still goes to pinned memory (as in the C++ driver), so only the input copy differs."""
    e2e: dict[str, list[float]] = {"device_ms": [], "pageable_ms": [], "pinned_ms": []}
    if stream is None:
        return e2e
    pageable_in = example.cpu()
    pinned_in = pageable_in.pin_memory()
    pageable_out = torch.empty(output["shape"], dtype=output["dtype"])
    pinned_out = pageable_out.pin_memory()

    def end_to_end(src: torch.Tensor | None, dst: torch.Tensor) -> float:
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):
            if src is not None:
                example.copy_(src, non_blocking=True)
            dst.copy_(forward(example), non_blocking=True)
        stream.synchronize()
        return (time.perf_counter() - t0) * 1e3

    for _ in range(iters):
        e2e["device_ms"].append(end_to_end(None, pinned_out))
        e2e["pageable_ms"].append(end_to_end(pageable_in, pageable_out))
        e2e["pinned_ms"].append(end_to_end(pinned_in, pinned_out))
    return e2e


def memory_pass(built: Built, example: torch.Tensor, gpu: bool, sync: Callable[[], None]) -> dict[str, Any]:
    """The allocator's peak over 3 steady-state calls after a reset, and what the rung knows of its memory."""
    memory: dict[str, Any] = {"allocator_peak_bytes": None, "allocator_reserved_peak_bytes": None}
    if gpu and built.uses_torch_allocator:
        memory["allocator_lifetime_peak_bytes"] = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(3):
            built.forward(example)
        sync()
        memory["allocator_peak_bytes"] = torch.cuda.max_memory_allocated()
        memory["allocator_reserved_peak_bytes"] = torch.cuda.max_memory_reserved()
    memory.update(built.stats.pop("memory", {}))
    known = ("weights_bytes", "gradient_bytes", "optimizer_state_bytes")
    if memory["allocator_peak_bytes"] and all(k in memory for k in known):  # a training step's split
        memory["activations_and_workspace_bytes"] = (memory["allocator_peak_bytes"] - example.nbytes
                                                     - sum(memory[k] for k in known))
    return memory


def util_pass(forward: Callable[[Any], Any], example: torch.Tensor, sync: Callable[[], None],
              seconds: float) -> dict[str, Any]:
    """Calls back to back (a sync every 4) for `seconds`, while the parent samples NVML; `marks`: [seconds since the
    pass began, calls done] about every UTIL_MARK_S, and at its end (a sustained cell's window is its last seconds)."""
    iters, marks = 0, [[0.0, 0]]
    t = time.perf_counter()
    while (elapsed := time.perf_counter() - t) < seconds:
        for _ in range(4):
            forward(example)
        iters += 4
        sync()
        if time.perf_counter() - t - marks[-1][0] >= UTIL_MARK_S:
            marks.append([time.perf_counter() - t, iters])
    if marks[-1][1] != iters:
        marks.append([elapsed, iters])
    return {"iters": iters, "seconds": elapsed, "marks": marks}


def measure(kv: dict[str, str], cell: Cell, tier: Any, built: Built, example: torch.Tensor,
            result: dict[str, Any], first: torch.Tensor | None) -> None:
    """The warm phases of docs/protocol.md on a built rung, into `result`; `first`: the first call's logits, which
    one more call after them must repeat (`repeatable`)."""
    stream = stream_of(built, cell)
    sync = sync_of(built, cell)
    output = result.pop("output")
    result["stream"] = built.stream_description
    forward = built.forward
    clock = Clock(stream)
    timed_call = timed_forward(forward, example, clock)

    # As timeit does: no garbage-collector pauses inside the timed phases (collected once before, enabled after).
    gc.collect()
    gc.disable()
    phase("warmup")
    result["warmup"] = warmup_pass(timed_call, kv)

    phase("latency")
    lat, host, stopped = latency_pass(timed_call, int(kv["iters"]), float(kv["min-time-s"]),
                                      float(kv["max-time-s"]), int(kv["max-iters"]), float(kv["precision"]))
    result["latency"] = {"samples_ms": lat, "stopped": stopped}
    result["host"] = {"samples_us": host}

    phase("pipelined")
    n = pipelined_iters(kv, lat)
    clock.start()
    for _ in range(n):
        forward(example)
    clock.stop()
    result["pipelined"] = {"iters": n, "total_ms": clock.elapsed_ms()}

    phase("e2e")
    result["e2e"] = end_to_end_pass(forward, example, stream, output, int(kv["e2e-iters"]))
    gc.enable()

    phase("memory")
    result["memory"] = memory_pass(built, example, cell.device == "cuda", sync)

    phase("util")
    result["util"] = util_pass(forward, example, sync, float(kv["util-s"]))

    if int(kv.get("census-steps", 0)):  # the kernel census (harness/run/census.py reads its trace in the parent)
        phase("census")
        result["census"] = profile.record(built, example, sync, int(kv["census-steps"]), Path(kv["census"]),
                                          cell.device == "cuda", scoped=not cell.cuda_graph)

    phase("after")  # rung facts that need the measured state (guard cost); outside every timing
    result["build_stats"] = {**built.stats, **tier.after(built, example, cell)}
    result["repeatable"] = repeatable(cell, built, example, first)
    if kv.get("hot-start") == "1":
        # The result first, whole: a hot start can take minutes (compile's max-autotune tunes the new shape again),
        # and a cell stopped there keeps its measurement; the file is written again with the hot start.
        save_result(kv, {**result, "rss_peak_bytes": peak_rss_bytes(),
                         "hot_start": {"error": "stopped during the hot start"}})
        phase("hot")
        result["hot_start"] = tier.hot_start(built, example, cell)


def peak_rss_bytes() -> int | None:
    """This process's own peak resident memory: VmHWM of /proc/self/status, which exec resets. Not getrusage's
    ru_maxrss, which carries the ladder parent's peak across fork and exec. None where there is no /proc (absent,
    not approximate). cpp/common/ladder/protocol.h peak_rss_bytes does the same."""
    return proc_bytes("/proc/self/status", "VmHWM")


def save_result(kv: dict[str, str], result: dict[str, Any]) -> None:
    write_text_atomic(Path(kv["result"]), json.dumps(result))  # the parent reads a whole result or none


def run_cell(kv: dict[str, str], options: dict[str, str]) -> dict[str, Any]:
    """One cell: cold part, then (unless --build-only 1) the warm phases. The result JSON of docs/protocol.md."""
    cell = cell_of(kv, options)
    result: dict[str, Any] = {"cold": {}}
    if cell.device == "cuda":  # per cell, in a process that measures several: peaks and caches of this cell only
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    if kv.get("train-data"):
        return train_on_data(kv, cell, result)
    if kv.get("eval-data"):
        return evaluate_on_data(kv, cell, result)
    tier, built, example, x_host = build(kv, cell, result)
    first = first_result(kv, cell, built, example, x_host, result)
    if kv.get("build-only") == "1":
        result.pop("output")
        return result
    measure(kv, cell, tier, built, example, result, first)
    phase("done")
    result["rss_peak_bytes"] = peak_rss_bytes()
    return result


def run_one(argv: list[str]) -> bool:
    """Runs one cell's contract; its result file, or an `@@error` line. Returns whether it succeeded."""
    kv, options = parse_argv(argv)
    try:  # a training step needs autograd; a forward runs as the eager reference does, in inference mode
        with torch.inference_mode(kv.get("task", "infer") == "infer"):
            result = run_cell(kv, options)
    except Exception as e:  # the traceback goes to stderr; the parent records the exception's own words
        traceback.print_exc()
        print(f"{ERROR}{type(e).__name__}: {' '.join(str(e).split())[:600]}", flush=True)
        return False
    finally:
        gc.collect()
    save_result(kv, result)
    return True


def main(argv: list[str]) -> int:
    """`--cells FILE`: a JSON list of single-cell command lines, measured in turn in this process (each announced
    with `@@cell I`; a failing cell reports `@@error` and the next one runs). Otherwise one cell's command line."""
    if argv[:1] == ["--cells"]:
        jobs = json.loads(open(argv[1]).read())
        ok = True
        for i, job in enumerate(jobs):
            print(f"{CELL}{i}", flush=True)
            ok &= run_one(job)
        return 0 if ok else 1
    return 0 if run_one(argv) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
