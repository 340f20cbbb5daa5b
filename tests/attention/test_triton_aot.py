"""Every Triton kernel compiles for a real GPU (sm_90: H100/H200), here, without one.

Triton's interpreter (the CPU tests) forgives what a GPU compile does not: a type the
backend cannot lower, a tile too large for shared memory or registers, a dot of shapes the
tensor cores cannot take. So each launch configuration the kernels' Python wrappers can
choose is compiled ahead of time with `triton.compile` for a CUDA target, down to a cubin
(Triton ships its own ptxas), and its shared memory is checked against what an sm_90 block
may use: bf16, fp16 and fp32; head dims 64, 80, 96, 128 and 256 (padded to a power of two);
GQA ratios 1, 3 and 8; block sizes 16 and 32.

The wrappers are run on CPU tensors with the kernels swapped for a recorder, so what is
compiled is exactly what they would launch (arguments, strides, constexprs, and the
16-divisibility Triton specializes on). Identical configurations are compiled once. It all
runs in a fresh process without TRITON_INTERPRET: in a process where the interpreter is on
(conftest.py turns it on without a GPU), Triton's code generator picks up the interpreter's
builder and fails on code that is fine.
"""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import triton  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from nanopaged.attention.metadata import AttentionMetadata  # noqa: E402
from nanopaged.attention import triton_kernels as tk  # noqa: E402

try:
    from triton.backends.compiler import GPUTarget
    HAS_CUDA_BACKEND = importlib.util.find_spec("triton.backends.nvidia") is not None
except ImportError:   # pragma: no cover
    HAS_CUDA_BACKEND = False

pytestmark = pytest.mark.skipif(not HAS_CUDA_BACKEND, reason="this Triton build cannot target CUDA")

TARGET = ("cuda", 90, 32)       # sm_90, warp size 32
SM90_SHARED_MEMORY = 227 * 1024   # bytes of shared memory one block may use on H100/H200
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
HEAD_DIMS = (64, 80, 96, 128, 256)
GQA_RATIOS = (1, 3, 8)
BLOCK_SIZES = (16, 32)
KV_HEADS = 2
TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
                torch.int64: "i64", torch.int32: "i32"}


class Recorder:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **constexprs)` is recorded."""

    def __init__(self, kernel):
        self.fn = kernel.fn if not isinstance(kernel, JITFunction) else kernel.fn
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **constexprs: self.launches.append((args, constexprs))


def signature(fn, args, constexprs):
    """Triton's view of one launch: argument types, constexprs, and the divisibility attrs."""
    names = JITFunction(fn).arg_names
    sig, attrs = {}, {}
    for i, (name, value) in enumerate(zip(names, args)):
        if isinstance(value, torch.Tensor):
            sig[name] = "*" + TRITON_TYPES[value.dtype]
            divisible = value.data_ptr() % 16 == 0
        elif isinstance(value, float):
            sig[name], divisible = "fp32", False
        else:
            sig[name] = "i32" if -2**31 <= value < 2**31 else "i64"
            divisible = value % 16 == 0
        if divisible:
            attrs[(i,)] = [["tt.divisibility", 16]]
    sig.update({name: "constexpr" for name in constexprs})
    return sig, constexprs, attrs


def launches(monkeypatch):
    """Every distinct launch of the three wrappers over the grid of configurations above."""
    recorders = {name: Recorder(getattr(tk, name)) for name in
                 ("_store_kvcache_kernel", "_gather_kvcache_kernel", "_paged_attention_kernel")}
    for name, recorder in recorders.items():
        monkeypatch.setattr(tk, name, recorder)
    for dtype in DTYPES.values():
        for head_dim in HEAD_DIMS:
            for block_size in BLOCK_SIZES:
                for ratio in GQA_RATIOS:
                    q, k, v, k_cache, v_cache, meta = batch(dtype, head_dim, block_size, ratio)
                    tk.paged_attention(q, k_cache, v_cache, meta, head_dim ** -0.5)
                tk.store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
                cu_k = torch.nn.functional.pad(meta.seq_lens.cumsum(0), (1, 0))
                tk.gather_kvcache(k_cache, v_cache, meta.block_tables.to(torch.int32),
                                  meta.seq_lens.to(torch.int32), cu_k.to(torch.int32))
    seen = {}
    for recorder in recorders.values():
        for args, constexprs in recorder.launches:
            sig, consts, attrs = signature(recorder.fn, args, constexprs)
            key = (recorder.fn.__name__, repr(sorted(sig.items())), repr(sorted(consts.items())), repr(attrs))
            seen.setdefault(key, (recorder.fn, sig, consts, attrs))
    return list(seen.values())


def batch(dtype, head_dim, block_size, ratio):
    """A mixed batch (a decode row, a prefill chunk after context) as the runner builds it."""
    heads, num_blocks = KV_HEADS * ratio, 8
    pool = torch.zeros(2, 2, num_blocks, block_size, KV_HEADS, head_dim, dtype=dtype)
    qkv = torch.zeros(6, (heads + 2 * KV_HEADS) * head_dim, dtype=dtype)     # fused projection output
    q = qkv[:, :heads * head_dim].view(6, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + KV_HEADS) * head_dim].view(6, KV_HEADS, head_dim)
    v = qkv[:, (heads + KV_HEADS) * head_dim:].view(6, KV_HEADS, head_dim)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(6), query_start_loc=torch.tensor([0, 1, 6]),
        seq_lens=torch.tensor([block_size + 3, 2 * block_size]), block_tables=torch.tensor([[0, 1], [2, 3]]),
        query_lens_list=[1, 5], seq_lens_list=[block_size + 3, 2 * block_size], block_size=block_size)
    return q, k, v, pool[1, 0], pool[1, 1], meta


def compile_all() -> list[str]:
    """Compile every configuration; a line for each that fails (run outside the interpreter)."""
    from _pytest.monkeypatch import MonkeyPatch
    with MonkeyPatch.context() as monkeypatch:
        configs = launches(monkeypatch)
    names = {fn.__name__ for fn, *_ in configs}
    assert names == {"_store_kvcache_kernel", "_gather_kvcache_kernel", "_paged_attention_kernel"}, names
    failures = []
    for fn, sig, consts, attrs in configs:
        try:
            compiled = triton.compile(ASTSource(fn=JITFunction(fn), signature=sig, constexprs=consts, attrs=attrs),
                                      target=GPUTarget(*TARGET))
            assert compiled.asm["cubin"], "no cubin"
            # Triton checks this only when the kernel is loaded on a GPU; check it here.
            assert compiled.metadata.shared <= SM90_SHARED_MEMORY, f"needs {compiled.metadata.shared} B of shared memory"
        except Exception as e:   # collect them all: one report names every configuration that fails
            failures.append(f"{fn.__name__} {consts} {sig}: {type(e).__name__}: {str(e)[-600:]}")
    print(f"compiled {len(configs) - len(failures)} of {len(configs)} configurations for sm_90")
    return failures


def test_every_kernel_configuration_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"     # Triton 3.9's default, said out loud to silence its warning
    # the checkout this test runs from, whether or not nanopaged is pip-installed
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]), env.get("PYTHONPATH", "")])
    code = ("import sys, test_triton_aot as t; failures = t.compile_all(); "
            "print(*failures, sep='\\n'); sys.exit(1 if failures else 0)")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-20000:] + done.stderr[-5000:]
    assert "configurations for sm_90" in done.stdout
