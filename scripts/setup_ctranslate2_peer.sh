#!/usr/bin/env bash
# Build the side environment bench.py's `ctranslate2` peer runs in: OpenNMT's CTranslate2 and what its
# Hugging Face converter needs.
#
#   bash scripts/setup_ctranslate2_peer.sh [VENV]  # default VENV: ~/.cache/nanopaged/ctranslate2-peer
#   python bench.py --peers ctranslate2             # finds it there (or --ctranslate2-python VENV/bin/python)
#
# CTranslate2 itself needs only numpy and pyyaml, but benchmarks/ctranslate2_peer.py converts the model
# folder once with its TransformersConverter, which loads the model through transformers and torch.
# torch comes from PyTorch's CPU index first: a bare `torch` requirement would pull a multi-GB CUDA
# build. transformers is the version nanopaged's own environment reads the demo folder with.
set -euo pipefail
venv="${1:-${NANOPAGED_CTRANSLATE2_VENV:-$HOME/.cache/nanopaged/ctranslate2-peer}}"
python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -q --upgrade pip
"$py" -m pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
"$py" -m pip install -q ctranslate2==4.8.5 transformers==5.24.0
"$py" -c "import ctranslate2, torch, transformers; print('ctranslate2', ctranslate2.__version__, 'torch', \
torch.__version__, 'transformers', transformers.__version__, 'cpu compute types', \
sorted(ctranslate2.get_supported_compute_types('cpu')))"
echo "CTranslate2 peer ready: $py"
