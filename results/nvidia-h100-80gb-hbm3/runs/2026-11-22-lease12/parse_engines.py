"""(Exploratory; kept beside its output.) Per convolution of one forward, the cuDNN engine ORT's CUDA EP executed at
batch 32 and at batch 256 (fp32, channels-last, EXHAUSTIVE search), with the numerical notes cuDNN gives each
engine. Input: cuDNN info-level logs (CUDNN_LOGLEVEL_DBG=3) of `python3 xp/ort_algos.py run 32|256`, ORT 1.31.1.

    python3 parse_engines.py cudnn_32.log cudnn_256.log > ort_fp32_cudnn_engines.txt
"""
import re
import sys


def blocks(path):
    return re.split(r"\n(?=[IWE]! CuDNN)", open(path, errors="replace").read())


def executed(path):
    """(input dims, filter dims, engine id) of every cudnnBackendExecute of a convolution, in order."""
    out = []
    for b in blocks(path):
        eng = re.search(r"engine_id: type=int; val=(\d+)", b)
        if "function cudnnBackendExecute()" in b and eng:
            x, w = re.findall(r"dimA: type=int; val=\[([0-9,]+)\]", b)[:2]
            out.append((x, w, int(eng.group(1))))
    return out


def notes(paths):
    found = {}
    for path in paths:
        for m in re.finditer(r"engine_id: type=int; val=(\d+);((?:\n[^\n]*){12})", open(path, errors="replace").read()):
            found.setdefault(int(m.group(1)), set()).update(re.findall(r"CUDNN_NUMERICAL_NOTE_(\w+): type=bool; val=true", m.group(2)))
    return found


small, large = executed(sys.argv[1]), executed(sys.argv[2])
note = notes(sys.argv[1:3])
small, large = small[: len(small) // 2], large[: len(large) // 2]  # two forwards were run: the first
print(f"{'conv input (b256)':>18s} {'filter':>12s}  {'b32 engine':24s} b256 engine")
for (_, w, e32), (x, _, e256) in zip(small, large):
    label = lambda e: f"{e} {','.join(sorted(note.get(e, ()))) or '-'}"
    mark = "  <- differs" if e32 != e256 else ""
    print(f"{x:>18s} {w:>12s}  {label(e32):24s} {label(e256)}{mark}")
