#!/usr/bin/env bash
# GPU check: prove nanopaged's CUDA path on a bare GPU machine in one call.
#
#   bash scripts/gpu_check.sh             run it (from anywhere: it works in the repository root)
#   bash scripts/gpu_check.sh --dry-run   print the plan and the output paths; run nothing
#   bash scripts/gpu_check.sh --only 'gpu tests,bench'   run these steps alone (a rerun after a fix)
#
# The machine needs torch (CUDA), triton, transformers, tokenizers, pytest, xxhash and tqdm,
# and nothing from a package index: nanopaged runs from the checkout (PYTHONPATH), pip is
# never called, tests that need the demo model skip, and the bench uses random weights with
# a tokenizer it trains itself. Everything is written to $OUT (default /tmp):
#   $OUT/gpu_check.log     every step's output, and a summary line per step
#   $OUT/gpu_bench.json    the bench's figures (nanopaged and the hf peer, same run)
#   $OUT/gpu_overlap.json  async scheduling on vs off (bench.py --workload overlap)
# Each test file runs in its own pytest process under its own timeout, so a CUDA crash (a
# device-side assert poisons the whole process) takes down one step only; the KV-sizing test,
# which allocates most of the GPU, runs last. The whole run stays under 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

dry_run=0
only=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry_run=1 ;;
    --only) only="${2:?--only needs a comma-separated list of step names}"; shift ;;
    *) echo "usage: bash scripts/gpu_check.sh [--dry-run] [--only 'step,step']" >&2; exit 2 ;;
  esac
  shift
done

out="${OUT:-/tmp}"
log="$out/gpu_check.log"
bench_json="$out/gpu_bench.json"
overlap_json="$out/gpu_overlap.json"
budget=450        # seconds for all steps together: 7.5 minutes, leaving a rerun room in 15
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TRITON_INTERPRET=0 PIP_NO_INDEX=1 \
       HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1

# name | timeout in seconds | command
steps=(
  "environment|60|python3 -c \"import torch, triton, transformers; assert torch.cuda.is_available(), 'no CUDA'; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())\""
  "gpu tests|120|python3 -m pytest -q -rs tests/test_gpu.py -k 'not kv_cache_sized'"
  "triton kernels|120|python3 -m pytest -q -rs tests/attention/test_triton_kernels.py"
  "triton backend|90|python3 -m pytest -q -rs tests/attention/test_triton_backend.py"
  "cuda graphs|90|python3 -m pytest -q -rs tests/attention/test_cuda_graphs.py"
  "bench|200|python3 bench.py --random-weights qwen3-0.6b --device cuda --num-requests 64 --input-len 100 512 --output-len 100 256 --peers hf --hf-batch-sizes 32,64 --json $bench_json"
  "overlap bench|150|python3 bench.py --workload overlap --random-weights qwen3-0.6b --device cuda --num-requests 32 --input-len 100 256 --output-len 32 64 --overlap-requests 256 --json $overlap_json"
  "kv sizing|90|python3 -m pytest -q -rs tests/test_gpu.py -k kv_cache_sized"
)

echo "gpu_check: log $log"
echo "gpu_check: bench json $bench_json"
echo "gpu_check: PYTHONPATH=$PYTHONPATH TRITON_INTERPRET=$TRITON_INTERPRET PIP_NO_INDEX=$PIP_NO_INDEX budget ${budget}s"
if [ -n "$only" ]; then                  # keep the named steps, in their order; a wrong name is an error
  IFS=',' read -ra wanted <<< "$only"
  kept=()
  for name in "${wanted[@]}"; do
    found=0
    for step in "${steps[@]}"; do
      [ "${step%%|*}" = "$name" ] && found=1
    done
    [ "$found" -eq 1 ] || { echo "gpu_check: no step named '$name'" >&2; exit 2; }
  done
  for step in "${steps[@]}"; do
    for name in "${wanted[@]}"; do
      [ "${step%%|*}" = "$name" ] && kept+=("$step")
    done
  done
  steps=("${kept[@]}")
fi
if [ "$dry_run" -eq 1 ]; then
  for step in "${steps[@]}"; do
    IFS='|' read -r name seconds cmd <<< "$step"
    echo "step: $name | timeout ${seconds}s | $cmd"
  done
  exit 0
fi

mkdir -p "$out"
: > "$log"
{ date; command -v nvidia-smi >/dev/null && nvidia-smi; } >> "$log" 2>&1
start=$(date +%s)
failed=0
summary=()
for step in "${steps[@]}"; do
  IFS='|' read -r name seconds cmd <<< "$step"
  left=$(( budget - ($(date +%s) - start) ))
  if [ "$left" -le 5 ]; then
    summary+=("$name: not run (the ${budget}s budget is spent)")
    failed=1
    continue
  fi
  [ "$seconds" -gt "$left" ] && seconds=$left
  echo "=== $name (timeout ${seconds}s): $cmd" | tee -a "$log"
  t0=$(date +%s)
  timeout "$seconds" bash -c "$cmd" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  [ "$rc" -eq 124 ] && rc="124 (timed out)"
  summary+=("$name: exit $rc after $(( $(date +%s) - t0 ))s")
  [ "$rc" != "0" ] && failed=1
  [ "$name" = environment ] && [ "$rc" != "0" ] && break    # no CUDA: nothing else can run
done
{
  echo "=== summary ($(( $(date +%s) - start ))s)"
  printf '%s\n' "${summary[@]}"
} | tee -a "$log"
exit "$failed"
