#!/usr/bin/env bash
# Build the side environment bench.py's `llama.cpp` peer runs in: llama-cpp-python, compiled here.
#
#   bash scripts/setup_llamacpp_peer.sh [VENV]    # default VENV: ~/.cache/nanopaged/llamacpp-peer
#   python bench.py --peers llama.cpp              # finds it there (or --llamacpp-python VENV/bin/python)
#
# PyPI has only its source, so pip compiles llama.cpp (about ten minutes on two cores). The flags are
# this project's CPUs' (docs/benchmarks.md, "llama.cpp"): AVX-512 with VNNI and BF16 where the CPU's flags
# list them. A -march=native build died with an illegal instruction on one of these VMs, and with AMX on
# gcc 12 fails to compile (_tile_loadconfig: target specific option mismatch), so the instruction sets
# are named one by one, AMX left out. NANOPAGED_LLAMACPP_CMAKE replaces the flags.
set -euo pipefail
venv="${1:-${NANOPAGED_LLAMACPP_VENV:-$HOME/.cache/nanopaged/llamacpp-peer}}"
flags=$(grep -m1 '^flags' /proc/cpuinfo || true)
cmake_args="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
for f in avx512f:GGML_AVX512 avx512_vnni:GGML_AVX512_VNNI avx512_bf16:GGML_AVX512_BF16; do
  case " $flags " in *" ${f%%:*} "*) cmake_args="$cmake_args -D${f##*:}=ON";; esac
done
cmake_args="${NANOPAGED_LLAMACPP_CMAKE:-$cmake_args}"
python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -q --upgrade pip
CMAKE_ARGS="$cmake_args" "$py" -m pip install -q --no-cache-dir llama-cpp-python==0.3.36
"$py" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
echo "llama.cpp peer ready: $py (CMAKE_ARGS: $cmake_args)"
