"""(Exploratory; ran as xp/ort_algos.py from the repository root on the H100 and is kept beside its data.)
Which cuDNN algorithms does ORT's CUDA EP run for ResNet-50 fp32 (channels-last, EXHAUSTIVE search)?
python3 xp/ort_algos.py run BATCH  (with CUDNN_LOGLEVEL_DBG=3 CUDNN_LOGDEST_DBG=LOG set), then
python3 xp/ort_algos.py parse LOG"""
import collections, os, re, sys
if sys.argv[1] == "parse":
    text = open(sys.argv[2], errors="replace").read()
    blocks = re.split(r"\n(?=I! CuDNN)", text)
    calls = collections.Counter(re.search(r"function (\w+)\(\)", b).group(1) for b in blocks if re.search(r"function (\w+)\(\)", b))
    print("calls:", dict(calls.most_common(25)))
    for fn in ("cudnnConvolutionForward", "cudnnConvolutionBiasActivationForward"):
        algos = collections.Counter()
        for b in blocks:
            if f"function {fn}()" in b:
                m = re.search(r"algo: type=cudnnConvolutionFwdAlgo_t; val=(\w+)", b)
                algos[m.group(1) if m else "?"] += 1
        print(fn, dict(algos))
    notes = collections.Counter(re.findall(r"CUDNN_NUMERICAL_NOTE_\w+", text))
    print("numerical notes mentioned:", dict(notes))
    engines = collections.Counter(re.findall(r"CUDNN_ATTR_ENGINE_GLOBAL_INDEX[^\n]*\n[^\n]*", text))
    print("engine index lines:", len(engines))
    sys.exit()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch
from harness.model import build_model
from tiers.base import Cell
from tiers.onnxruntime import TIER
batch = int(sys.argv[2])
cell = Cell(tier="onnxruntime", batch=batch, dtype="fp32", channels_last=True)
x = torch.randn(batch, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
built = TIER.build(build_model("resnet50").eval(), x, cell)
for _ in range(2):
    built.forward(x)
torch.cuda.synchronize()
