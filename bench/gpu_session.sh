#!/usr/bin/env bash
# The GPU runs behind results/<device>/, in groups that each fit one device call (<10 min) on one warm machine.
# All groups record into one run directory (cell by cell; a group rerun skips recorded cells) and each group ends
# by writing the merged JSON + markdown of everything recorded so far to $OUT.
#   bash bench/gpu_session.sh GROUP      GROUP: python | compile | cpp-cudnn | triton | recheck
# A lease lasts at most 30 minutes and a warm machine waits only 30 s between calls: issue the calls back to back.
set -uo pipefail
RUN=${RUN:-runs/gpu}
OUT=${OUT:-/tmp/out}
START=${START:-$(date +%s)}  # a caller running several groups in one call passes its own start
# The protocol of the committed results: every cell in a fresh process; short passes so that the whole session fits
# the device budget (latency: >= 30 iterations and >= 0.5 s; median over hundreds of samples at small batches).
Q="--channels-last --warmup-s 1 --min-time 0.5 --iters 30 --util-s 0.5 --e2e-iters 5 --out $RUN"
ladder() {  # stops itself (Ctrl-C: cells already recorded stay) so that the call ends inside the device's limit
  local left=$((570 - ($(date +%s) - START)))
  [ "$left" -gt 20 ] || { echo "no time left for: $*"; return 0; }
  COLUMNS=200 timeout -s INT -k 15 "$left" python3 -m harness ladder $Q "$@"
}
case "$1" in
  python)     # the ladder issue's Python rungs (compile is its own group), plus eager in a CUDA graph
    ladder --tiers eager,torchscript,onnxruntime --batch 1,32,256 --dtype fp32,tf32,bf16
    ladder --tiers eager --cuda-graph on --batch 1,32,256 --dtype bf16 ;;
  compile)    # torch.compile default, cold (fresh caches per cell); then the independent plain-loop check
    ladder --tiers compile --batch 1,32,256 --dtype fp32,tf32,bf16
    python3 -m harness report "$RUN/results.jsonl" --json "$OUT/ladder.json" >/dev/null
    timeout -k 10 $((570 - ($(date +%s) - START))) python3 bench/plain_loop.py --batch 1,32,256 \
      --dtype fp32,bf16 --channels-last --compare "$OUT/ladder.json" --json "$OUT/plain_loop.json" ;;
  cpp-cudnn)  # LibTorch C++ rungs and the hand-written cuDNN rung (plain and in a CUDA graph)
    ladder --tiers libtorch,torchscript-cpp --batch 1,32,256 --dtype fp32,bf16
    ladder --tiers cudnn --batch 1,32,256 --dtype fp32,bf16 --cuda-graph both ;;
  triton)     # hand-written Triton (autotune cache shared between its cells), compile reduce-overhead, micro
    ladder --tiers triton --batch 1,32,256 --dtype bf16 --cuda-graph both --warm-cache
    ladder --tiers compile --compile-mode reduce-overhead --batch 1,32,256 --dtype bf16
    python3 -m harness micro --tier cudnn --batch 256 --res 224 --dtype bf16 --channels-last \
      --json "$OUT/micro_cudnn.json" --markdown "$OUT/micro_cudnn.md"
    timeout -k 10 $((570 - ($(date +%s) - START))) python3 -m harness micro --tier triton --batch 256 --res 224 \
      --dtype bf16 --channels-last --json "$OUT/micro_triton.json" --markdown "$OUT/micro_triton.md" ;;
  recheck)    # host-bound cells again, then the plain loop on the same lease (the independent check)
    ladder --tiers eager,compile --batch 1,32 --dtype fp32,bf16
    python3 -m harness report "$RUN/results.jsonl" --json "$OUT/ladder.json" >/dev/null
    timeout -k 10 $((570 - ($(date +%s) - START))) python3 bench/plain_loop.py --batch 1,32 \
      --dtype fp32,bf16 --channels-last --compare "$OUT/ladder.json" --json "$OUT/plain_loop.json" ;;
  *) echo "unknown group $1; valid: python compile cpp-cudnn triton recheck" >&2; exit 2 ;;
esac
python3 -m harness report "$RUN/results.jsonl" --json "$OUT/ladder.json" --markdown "$OUT/ladder.md" >/dev/null
cp "$RUN/results.jsonl" "$RUN/run.json" "$OUT/"
