"""(Exploratory; ran as xp/ort_nhwc.py from the repository root on the H100 and is kept beside its data.)
ORT CUDA EP fp32 b256 parity against eager fp32 (TF32 off) for prefer_nhwc 1/0, conv searches, use_tf32.
Usage: python3 xp/ort_nhwc.py BATCH [LOGRUN]"""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch
from harness.model import build_model
from harness.parity import compare
from tiers.base import Cell
from tiers.onnxruntime import TIER
batch = int(sys.argv[1])
torch.backends.cudnn.allow_tf32 = False
torch.backends.cuda.matmul.allow_tf32 = False
model = build_model("resnet50").eval()
x = torch.randn(batch, 3, 224, 224, generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    ref = model.cuda()(x.cuda()).float().cpu()
model = model.cpu()
orig = TIER.provider_options
configs = [("1", "EXHAUSTIVE", "0")] if len(sys.argv) > 2 else [
    ("1", "EXHAUSTIVE", "0"), ("0", "EXHAUSTIVE", "0"), ("0", "HEURISTIC", "0"), ("1", "DEFAULT", "0")]
for nhwc, search, tf32 in configs:
    TIER.provider_options = lambda cell, stream: {**orig(cell, stream), "prefer_nhwc": nhwc, "use_tf32": tf32}
    cell = Cell(tier="onnxruntime", batch=batch, dtype="fp32", channels_last=True,
                options=(("conv-algo-search", search),))
    xd = x.cuda().to(memory_format=torch.channels_last)
    built = TIER.build(model, xd, cell)
    out = built.forward(xd); torch.cuda.synchronize()
    p = compare(out.float().cpu(), ref, "fp32")
    print(f"RESULT prefer_nhwc={nhwc} search={search} use_tf32={tf32}: rel_err {p['rel_err']:.3e} ok={p['ok']}", flush=True)
