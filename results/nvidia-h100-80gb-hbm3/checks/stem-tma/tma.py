"""The fused stem through TMA: (1) the stem kernel alone under explicit configurations (do_bench_cudagraph), each
checked against PyTorch; (2) the whole triton network under a CUDA graph with the shipped stem configuration against
the best TMA one, alternating in one process, each kernel's own time, outputs compared. JSON lines to argv[1]."""
import json, statistics, sys, traceback
sys.path.insert(0, ".")
import torch, torch.nn.functional as F
from triton.testing import do_bench_cudagraph
from kernels.triton.stem import pack_stem, stem
out = open(sys.argv[1], "a")
def emit(rec):
    print(json.dumps(rec), flush=True); out.write(json.dumps(rec) + "\n"); out.flush()
def cfg(rows, bw, bc, band, bk, stages, warps, tma=False):
    return dict(ROWS=rows, BLOCK_W=bw, BLOCK_C=bc, BAND_TILES=band, BLOCK_K=bk, TMA=tma, num_stages=stages, num_warps=warps)
torch.manual_seed(0)
conv = torch.nn.Conv2d(3, 64, 7, 2, 3, bias=False)
PLANS = {256: [cfg(1, 64, 64, 29, 16, 4, 4)] + [cfg(1, 64, 64, band, 16, st, w, True) for band, st, w in
              ((29, 4, 4), (29, 3, 4), (29, 5, 4), (29, 6, 4), (15, 4, 4), (8, 4, 4), (29, 4, 8), (29, 3, 8))]
              + [cfg(1, 64, 32, 29, 16, 4, 4, True), cfg(1, 64, 32, 29, 16, 6, 4, True)],
         32: [cfg(1, 64, 64, 8, 16, 4, 4), cfg(1, 64, 64, 8, 16, 4, 4, True), cfg(1, 64, 64, 4, 16, 4, 4, True)]}
best = {}
for dt, prec, km, dtype in (("bf16", "tf32", False, torch.bfloat16), ("tf32", "tf32", True, torch.float32)):
    for batch, plans in PLANS.items():
        x = torch.randn(batch, 3, 224, 224, device="cuda")
        torch.backends.cudnn.allow_tf32 = False
        ref = F.max_pool2d(F.relu(F.conv2d(x, conv.weight.cuda(), None, 2, 3)), 3, 2, 1)
        xb = x.permute(0, 2, 3, 1).contiguous().to(dtype)
        p = pack_stem(conv.weight, dtype=dtype, device="cuda", kmajor=km)
        for c in plans:
            try:
                y = stem(xb, p, precision=prec, tune=False, untuned=c)
                err = ((y.permute(0, 3, 1, 2).float() - ref).abs().max() / ref.abs().max()).item()
                us = statistics.median(do_bench_cudagraph(lambda: stem(xb, p, precision=prec, tune=False, untuned=c))
                                       * 1e3 for _ in range(3))
                rec = {"dtype": dt, "batch": batch, "config": c, "us_with_s2d": round(us, 2), "rel_err": err}
                if err < 2e-2 and us < best.get((dt, batch), (1e9,))[0]:
                    best[(dt, batch)] = (us, c)
            except Exception as e:
                rec = {"dtype": dt, "batch": batch, "config": c, "error": repr(e)[:400]}
                traceback.print_exc()
            emit(rec)
        if dt == "tf32":
            break  # tf32: batch 256 only
# (2) the network, bf16, shipped stem against the best TMA configuration
from bench.chain_tune import Chain, pipelined_us, owned_us
for batch in (256, 32):
    chain = Chain("resnet50", batch, 224, "bf16")
    key = next(k for k in chain.shipped if k.startswith(f"stem_pool_kernel|{batch},"))
    us, c = best[("bf16", batch)]
    if not c["TMA"]:
        emit({"batch": batch, "network": "skipped: no TMA configuration was faster alone", "best": c}); continue
    entry = {"kwargs": {k: v for k, v in c.items() if not k.startswith("num_")}, "num_warps": c["num_warps"],
             "num_stages": c["num_stages"]}
    graphs = {"shipped": chain.graph(chain.shipped), "tma": chain.graph({**chain.shipped, key: entry})}
    outs = {}
    for name, g in graphs.items():
        g.replay(); torch.cuda.synchronize()
        outs[name] = next(iter(g.plans.values())).output.float().clone()
    replays = max(20, 12000 // batch)
    times = {n: [] for n in graphs}
    for _ in range(9):
        for n, g in graphs.items():
            times[n].append(pipelined_us(g, replays))
    own = {n: [round(v, 2) for v in owned_us(g, len(chain.keys))[:3]] for n, g in graphs.items()}
    emit({"batch": batch, "key": key, "shipped_entry": chain.shipped[key], "tma_entry": entry,
          "median_us": {n: round(statistics.median(t), 1) for n, t in times.items()},
          "per_replay_us": {n: [round(v, 1) for v in t] for n, t in times.items()}, "first_kernels_own_us": own,
          "outputs_max_abs_diff": (outs["shipped"] - outs["tma"]).abs().max().item(), "gpu": torch.cuda.get_device_name()})
