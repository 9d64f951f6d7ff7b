#!/usr/bin/env bash
# The GPU runs behind results/<device>/, in groups that each fit one device call (<10 min) on one warm machine.
# All groups record into one run directory (cell by cell; a group rerun skips recorded cells) and each group ends
# by writing the merged JSON + markdown of everything recorded so far to $OUT.
#   bash bench/gpu_session.sh GROUP   GROUP: cpp | cudnn | check | triton (lease A); ro-cudnn | triton-checks | recheck | trt (lease B); host | grid | long | ort (session 3); ort-search | loose-ends | interleave (session 4); adjacent | ort-default (session 6); final (session 7)
# Each lease measures eager and compile again, so that every rung sits beside them in one run (RUN, one per lease).
# A lease lasts at most 30 minutes and a warm machine waits only 30 s between calls: issue the calls back to back.
# A device call brings back at most 8 files from its $OUT, so a call runs a group with OUT=/tmp/o (outside the
# device's $OUT) and ends with: cd /tmp/o && find . -name "*.json*" -o -name "*.md" -o -name "*.txt" | tar czf $OUT/o.tgz -T -
# (run directories hold inputs and weights of hundreds of MB: never archive them whole).
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
  COLUMNS=200 timeout -s INT -k 15 "$left" ${PIN:-} python3 -m harness ladder $Q "$@"
}
sweep() {  # parity of rung $1 in dtypes $2 over batches $3 x resolutions: a one-iteration protocol, its timings no figures
  local left=$((570 - ($(date +%s) - START)))
  [ "$left" -gt 20 ] || { echo "no time left for: sweep $*"; return 0; }
  COLUMNS=200 timeout -s INT -k 15 "$left" python3 -m harness ladder --tiers "$1" --dtype "$2" --batch "${3:-1,7,32,256}" \
    --res 64,224,320 --channels-last --warmup-s 0 --warmup-max 1 --iters 1 --min-time 0 --util-s 0 --e2e-iters 1 \
    --warm-cache --out "$RUN-parity" --markdown "$OUT/parity_$1.md" --json "$OUT/parity_$1.json"
}
case "$1" in
  cpp)        # lease A, call 1: eager (plain and in a CUDA graph) beside the LibTorch C++ rungs
    ladder --tiers eager --batch 1,32,256 --dtype fp32,bf16
    ladder --tiers eager --cuda-graph on --batch 1,32,256 --dtype bf16
    ladder --tiers libtorch,torchscript-cpp --batch 1,32,256 --dtype fp32,bf16
    ladder --tiers cudnn --batch 1,32,256 --dtype bf16,fp32 --cuda-graph both ;;
  cudnn)      # lease A, call 2: the hand-written cuDNN rung (plain and graphed), torch.compile default beside it
    ladder --tiers cudnn --batch 1,32,256 --dtype bf16,fp32 --cuda-graph both
    ladder --tiers compile --batch 1,32,256 --dtype bf16
    ladder --tiers compile --batch 1,32,256 --dtype fp32 ;;
  check)      # lease A, call 3: the plain-loop check of eager and compile, then cuDNN parity over shapes
    ladder --tiers compile --batch 1,32,256 --dtype fp32
    python3 -m harness report "$RUN/results.jsonl" --json "$OUT/ladder.json" >/dev/null
    timeout -k 10 $((400 - ($(date +%s) - START))) python3 bench/plain_loop.py --batch 1,32,256 \
      --dtype fp32,bf16 --channels-last --compare "$OUT/ladder.json" --json "$OUT/plain_loop.json"
    sweep cudnn fp32,bf16 ;;
  ro-cudnn)   # lease B: compile reduce-overhead (the Triton rung's batch-1 baseline); the cuDNN rung's last checks
    ladder --tiers compile --compile-mode reduce-overhead --batch 1,32,256 --dtype bf16
    sweep cudnn bf16 256
    python3 -m harness micro --tier cudnn --batch 256 --res 224 --dtype bf16 --channels-last \
      --json "$OUT/micro_cudnn.json" --markdown "$OUT/micro_cudnn.md"
    timeout -k 10 $((570 - ($(date +%s) - START))) python3 bench/sanitize_cudnn.py 2>&1 | tee "$OUT/sanitizer.txt" ;;
  triton-checks)  # lease B: the Triton rung's parity over shapes and its per-layer microbenchmark
    sweep triton bf16
    timeout -k 10 $((570 - ($(date +%s) - START))) python3 -m harness micro --tier triton --batch 256 --res 224 \
      --dtype bf16 --channels-last --json "$OUT/micro_triton.json" --markdown "$OUT/micro_triton.md" ;;
  recheck)    # lease B: host-bound cells of eager and compile, then the plain loop twice (its own spread)
    ladder --tiers eager,compile --batch 1,32 --dtype bf16,fp32
    python3 -m harness report "$RUN/results.jsonl" --json "$OUT/ladder.json" >/dev/null
    for i in 1 2; do
      timeout -k 10 $((570 - ($(date +%s) - START))) python3 bench/plain_loop.py --batch 1,32 --dtype bf16,fp32 \
        --channels-last --compare "$OUT/ladder.json" --json "$OUT/plain_loop_$i.json"
    done ;;
  trt)        # lease B (onnxruntime-gpu staged): what `tiers` says on the H100; the TensorRT rungs' cells
    COLUMNS=200 python3 -m harness tiers | tee "$OUT/tiers.txt"
    ladder --tiers tensorrt,ort-tensorrt --batch 1,32,256 --dtype fp32,tf32,bf16 ;;
  host)       # lease 5 (session 3): is the host steady? its CPUs alone (no GPU), then host-bound cells over 10 s
              # windows, unpinned and pinned to one core (PIN), each with the plain loop right after
    { lscpu; nvidia-smi topo -m; cat /proc/loadavg; ps -eo pcpu,rss,comm --sort=-pcpu | head -8
      grep MHz /proc/cpuinfo | sort | uniq -c; cat /sys/devices/system/cpu/cpu0/cpufreq/scaling_governor; } \
      > "$OUT/host_facts.txt" 2>&1
    python3 -m harness.host_noise --cpus 0,4,8,12 --seconds 20 --json "$OUT/host_noise.json"
    for pin in "" "taskset -c 3"; do
      tag=${pin:+-pinned}
      PIN=$pin ladder --tiers eager,compile --batch 1 --dtype bf16 --min-time 10 --out "$RUN$tag"
      python3 -m harness report "$RUN$tag/results.jsonl" --json "$OUT/ladder$tag.json" --markdown "$OUT/ladder$tag.md" >/dev/null
      $pin python3 bench/plain_loop.py --batch 1 --dtype bf16 --channels-last --min-time-s 10 \
        --compare "$OUT/ladder$tag.json" --json "$OUT/plain_loop$tag.json"
    done ;;
  grid)       # lease 6 (session 3; issue the call until two plain loops ran): eager and compile over the grid
              # (2.5 s a cell), then the plain loop right after, as often as time allows
    ladder --tiers eager,compile --batch 1,32,256 --dtype bf16,fp32,tf32 --min-time 2.5
    python3 -m harness report "$RUN/results.jsonl" --json "$OUT/ladder.json" >/dev/null
    left=$((570 - ($(date +%s) - START)))
    [ "$left" -gt 300 ] && timeout -k 10 "$left" python3 bench/plain_loop.py --batch 1,32,256 --dtype bf16,fp32,tf32 \
      --channels-last --min-time-s 2.5 --compare "$OUT/ladder.json" --json "$OUT/plain_loop_$(date +%H%M%S).json" ;;
  long)       # lease 7 (session 3): do long windows steady host-bound cells? eager and compile at batch 1 for 20 s,
              # ladder then plain loop, twice
    for i in 1 2; do
      ladder --tiers eager,compile --batch 1 --dtype bf16 --min-time 20 --out "$RUN-long$i"
      python3 -m harness report "$RUN-long$i/results.jsonl" --json "$OUT/ladder-long$i.json" >/dev/null
      timeout -k 10 $((570 - ($(date +%s) - START))) python3 bench/plain_loop.py --batch 1 --dtype bf16 \
        --channels-last --min-time-s 20 --compare "$OUT/ladder-long$i.json" --json "$OUT/plain_loop-long$i.json"
    done ;;
  ort)        # onnxruntime-gpu staged (source /tmp/stage-install.sh first): what `tiers` says, then both ORT rungs
    COLUMNS=200 python3 -m harness tiers | tee "$OUT/tiers.txt"
    ladder --tiers onnxruntime,ort-tensorrt --batch 1,32,256 --dtype fp32,tf32,bf16 ;;
  ort-search) # session 4 (onnxruntime-gpu staged): the CUDA EP's three cuDNN algorithm searches side by side, with
              # eager beside them (ORT fp32 b256 failed parity under EXHAUSTIVE, ORT's default, in leases 1 and 8)
    ladder --tiers eager --batch 32,256 --dtype fp32,tf32
    for search in EXHAUSTIVE HEURISTIC DEFAULT; do
      ladder --tiers onnxruntime --batch 32,256 --dtype fp32,tf32 --option "onnxruntime:conv-algo-search=$search"
    done ;;
  loose-ends) # session 4: what earlier sessions left unrun on the GPU: Triton in fp16 (eager beside it), LibTorch in
              # a CUDA graph, and bench/sanitize_cudnn.py itself
    ladder --tiers eager --batch 1,32,256 --dtype fp16
    ladder --tiers triton --batch 1,32,256 --dtype fp16 --cuda-graph both --warm-cache
    ladder --tiers libtorch --batch 1,32,256 --dtype bf16 --cuda-graph both
    timeout -k 10 $((570 - ($(date +%s) - START))) python3 bench/sanitize_cudnn.py 2>&1 | tee "$OUT/sanitizer.txt" ;;
  interleave) # session 4 (two calls: the ladder, then the plain loop): host-bound cells and a GPU-bound control (fp32
              # b32); the plain loop alternates 0.25 s blocks with the ladder's own code in one process (same host)
    ladder --tiers eager,compile --batch 1,32 --dtype bf16,tf32,fp32 --min-time 2.5
    python3 -m harness report "$RUN/results.jsonl" --json "$OUT/ladder.json" >/dev/null
    left=$((570 - ($(date +%s) - START)))
    [ "$left" -gt 400 ] && timeout -k 10 "$left" python3 bench/plain_loop.py --batch 1,32 --dtype bf16,tf32,fp32 \
      --channels-last --min-time-s 5 --interleave-s 0.25 --compare "$OUT/ladder.json" --json "$OUT/interleaved.json" ;;
  ort-default) # session 6 (onnxruntime-gpu staged): what ort-search ran out of time for, DEFAULT search in tf32 (and
              # fp32 again) at b32 and b256, with eager beside it
    ladder --tiers eager --batch 32,256 --dtype tf32,fp32
    ladder --tiers onnxruntime --batch 32,256 --dtype tf32,fp32 --option "onnxruntime:conv-algo-search=DEFAULT" ;;
  adjacent)   # session 6 (DTYPES per call): each host-bound cell and the GPU-bound control, then the plain loop for that
              # one cell in a fresh process right after it: seconds apart, not the minutes of a whole ladder
    mkdir -p "$OUT/adjacent"
    for dtype in ${DTYPES:-bf16 tf32 fp32}; do for batch in 1 32; do for tier in eager compile; do
      plain="$OUT/adjacent/$tier-b$batch-$dtype.json"
      [ -f "$plain" ] && continue  # done in an earlier call on this machine
      ladder --tiers "$tier" --batch "$batch" --dtype "$dtype" --min-time 2.5
      python3 -m harness report "$RUN/results.jsonl" --json "$OUT/ladder.json" >/dev/null
      left=$((570 - ($(date +%s) - START)))
      [ "$left" -gt 60 ] && timeout -k 10 "$left" python3 bench/plain_loop.py --tiers "$tier" --batch "$batch" \
        --dtype "$dtype" --channels-last --min-time-s 2.5 --compare "$OUT/ladder.json" --json "$plain"
    done; done; done ;;
  final)      # session 7 (issue the call until the plain loop has run): the grid for eager, torchscript and
              # compile at one commit (2.5 s a cell), then the plain loop right after it over the same grid
    ladder --tiers eager,torchscript,compile --batch 1,32,256 --dtype fp32,tf32,bf16 --min-time 2.5
    python3 -m harness report "$RUN/results.jsonl" --json "$OUT/ladder.json" >/dev/null
    left=$((570 - ($(date +%s) - START)))
    [ "$left" -gt 240 ] && [ ! -f "$OUT/plain_loop.json" ] && timeout -k 10 "$left" python3 bench/plain_loop.py \
      --batch 1,32,256 --dtype fp32,tf32,bf16 --channels-last --min-time-s 2.5 --compare "$OUT/ladder.json" \
      --json "$OUT/plain_loop.json" ;;
  *) echo "unknown group $1; valid: cpp cudnn check triton ro-cudnn triton-checks recheck trt host grid long ort ort-search loose-ends interleave adjacent ort-default final" >&2; exit 2 ;;
esac
python3 -m harness report "$RUN/results.jsonl" --json "$OUT/ladder.json" --markdown "$OUT/ladder.md" >/dev/null
cp "$RUN/results.jsonl" "$RUN/run.json" "$OUT/"
