#!/usr/bin/env bash
# The GPU runs behind results/<device>/, in groups that each fit one device call (<10 min). All groups write into
# one run directory (cells are recorded as they finish; a group rerun skips recorded cells), and each group copies
# the merged JSON + markdown to $OUT. Usage: bash bench/gpu_session.sh GROUP   (GROUP: python1 python2 cpp hand)
set -euo pipefail
RUN=${RUN:-runs/gpu}
OUT=${OUT:-/tmp/out}
Q="--channels-last --warmup-s 2 --util-s 1 --e2e-iters 10 --out $RUN"
ladder() { COLUMNS=200 python3 -m harness ladder $Q --json "$OUT/ladder.json" --markdown "$OUT/ladder.md" "$@"; }
case "$1" in
  python1)  # the Python rungs of the ladder issue, fp32 / tf32 / bf16 at batch 1, 32, 256
    ladder --tiers eager,torchscript,onnxruntime --batch 1,32,256 --dtype fp32,tf32,bf16 ;;
  python2)  # torch.compile default (cold, fresh cache per cell), then the independent plain-loop check
    ladder --tiers compile --batch 1,32,256 --dtype fp32,tf32,bf16
    python3 bench/plain_loop.py --batch 1,32,256 --dtype fp32,tf32,bf16 --channels-last \
      --compare "$OUT/ladder.json" --json "$OUT/plain_loop.json" ;;
  cpp)      # LibTorch C++ rungs beside eager
    ladder --tiers eager,libtorch,torchscript-cpp --batch 1,32,256 --dtype fp32,bf16 ;;
  hand)     # hand-written rungs, with and without CUDA graphs, beside eager and compile (reduce-overhead too)
    ladder --tiers eager,cudnn,triton --batch 1,32,256 --dtype fp32,bf16 --cuda-graph both
    ladder --tiers compile --compile-mode reduce-overhead --batch 1,32,256 --dtype bf16 ;;
  *) echo "unknown group $1; valid: python1 python2 cpp hand" >&2; exit 2 ;;
esac
