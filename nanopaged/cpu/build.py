"""nanopaged's C++ CPU kernels (csrc/ beside this file), compiled on first use.

csrc/ holds one file per concern (csrc/ops.h lists them), every .cpp compiled into the one
module nanopaged_cpu_ops. torch's extension builder compiles them once per machine and source
version and caches the library under ~/.cache/torch_extensions (or $TORCH_EXTENSIONS_DIR), in a
folder named by a hash of every source and header, the flags, the torch install and Python
(`build_folder`); later loads take a fraction of a second. The sources are compiled from copies
in that folder: torch's builder rebuilds when a source's path (or torch's) changes, so two
checkouts or two environments (a clone CI runs beside a working tree) would otherwise rebuild
each other's library, one process overwriting it while another loads it.
A build killed midway (a server stopped while it compiled) leaves torch's own lock file behind,
and torch's builder waits for that file to vanish, forever: `locked_load` holds a lock the
operating system drops when its holder dies, and with it held removes such a leftover.
The instruction sets are the CPU's own, named from its flags: a -march=native build has
produced code a VM could not run. Where no compiler or ninja is found, `available()` says why
and the torch reference runs instead.
docs/05_model_runner_and_kernels.md, "Fused CPU kernels".
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import sys
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

from nanopaged.cpu.features import cpu_flags

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = sorted(CSRC.glob("*.cpp"))    # each compiled on its own, linked into the one module
HEADERS = sorted(CSRC.glob("*.h"))      # what they include of each other: copied and hashed with them
# Reassociating float sums lets the compiler vectorize the dot products and reductions.
# -fopenmp: at::parallel_for is an inline OpenMP loop in torch's headers, serial without it; the
# library then asks for libgomp.so.1, which resolves to the copy torch has already loaded.
OPT_FLAGS = ["-O3", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math", "-fopenmp"]
# the CPU's flag (as /proc/cpuinfo spells it) -> gcc's name for the instruction set
ISA_FLAGS = {"avx2": "avx2", "fma": "fma", "f16c": "f16c", "avx512f": "avx512f", "avx512bw": "avx512bw",
             "avx512vl": "avx512vl", "avx512_bf16": "avx512bf16", "avx512_vnni": "avx512vnni",
             "amx_tile": "amx-tile", "amx_bf16": "amx-bf16", "amx_int8": "amx-int8"}


def missing_tools() -> str | None:
    """What building the kernels needs and this machine lacks, or None."""
    if not any(shutil.which(c) for c in ("c++", "g++")):
        return "a C++ compiler (c++ or g++ on the PATH)"
    try:
        from torch.utils.cpp_extension import is_ninja_available
    except ImportError:
        return "torch.utils.cpp_extension"
    if not is_ninja_available():
        return "ninja (pip install ninja)"
    return None


@lru_cache(maxsize=1)
def cpu_ops():
    """The compiled module (csrc/bindings.cpp): rms_norm, add_rms_norm, store_kv, rotary_and_store,
    paged_attention, silu_and_mul, argmax_rows, pack_quantized and linear_quantized (4- and 8-bit),
    pack_bf16_weight, linear_bf16 and linear_bf16_silu_mul (where it was built with AVX512-BF16:
    `has_avx512_bf16`; elsewhere they raise), decoder_forward with the classes it takes (Decoder,
    Layer, Linear, LinearKind), and `has_avx512`."""
    return build("nanopaged_cpu_ops", [gcc for flag, gcc in ISA_FLAGS.items() if flag in cpu_flags()])


def build(name: str, isa: list[str]):
    """csrc/ compiled for the instruction sets `isa` (gcc's names: avx2, avx512f, ...): with
    avx512f its Vec16 (vec16.h) is one AVX-512 register, without it an array the compiler splits.
    The tests build an AVX2-only copy too, so the path an AVX2 host runs is checked on any host."""
    cflags = OPT_FLAGS + [f"-m{f}" for f in isa]
    folder = build_folder(name, cflags)
    for path in SOURCES + HEADERS:
        copy = folder / path.name
        if not copy.exists():                # written whole or not at all: another process may be here too
            partial = folder / f".{path.name}.{os.getpid()}"
            partial.write_bytes(path.read_bytes())
            os.replace(partial, copy)
    return locked_load(name, folder, sources=[str(folder / p.name) for p in SOURCES], extra_cflags=cflags,
                       extra_ldflags=["-fopenmp"])


@contextmanager
def build_lock(folder: Path):
    """Hold `folder`'s build lock: an flock, which the kernel releases when its holder exits or is
    killed, so a dead builder never blocks the next one. Says so on stderr when another process
    holds it. Not reentrant: a second hold in the same process would wait on the first."""
    with open(folder / "build.flock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"nanopaged: waiting for another build of the CPU kernels in {folder} to finish",
                  file=sys.stderr, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        yield                                        # closing the file releases the lock


def locked_load(name: str, folder: Path, **load_args):
    """torch's `load(name, build_directory=folder, **load_args)` under `folder`'s build lock. Every
    builder of `folder` goes through here, so with the lock held nobody else is building, and a
    `lock` file of torch's (which it creates and waits on, unaware of dead holders) is a leftover
    of a killed build: removed before torch looks for it."""
    from torch.utils.cpp_extension import load
    with build_lock(folder):
        (folder / "lock").unlink(missing_ok=True)
        return load(name, build_directory=str(folder), verbose=False, **load_args)


def build_folder(name: str, cflags: list[str]) -> Path:
    """Where `name` is built: one folder per (sources and headers, flags, torch install, Python), so
    a library is never rebuilt in place under a process that has it loaded. The torch install's path
    counts: the build names its headers and libraries by path, so two environments with the same
    torch version would otherwise rebuild each other's library."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root
    key = hashlib.sha256()
    for path in SOURCES + HEADERS:           # each file's name and length, then its bytes
        data = path.read_bytes()
        key.update(f"{path.name}:{len(data)}:".encode() + data)
    key.update(repr((cflags, torch.__version__, torch.__file__, sys.version_info[:2])).encode())
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()    # as torch's own load reads it
    folder = Path(root) / "nanopaged" / f"{name}-{key.hexdigest()[:16]}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@lru_cache(maxsize=1)
def available() -> str | None:
    """None when the kernels load here; else why not (the build's error, shortened)."""
    missing = missing_tools()
    if missing:
        return f"building nanopaged's CPU kernels needs {missing}"
    try:
        cpu_ops()
    except Exception as e:          # a failed build: say so once and run the reference
        logger.warning("nanopaged's CPU kernels did not build (%s); running the torch reference", str(e)[:300])
        return f"nanopaged's CPU kernels did not build: {str(e)[:300]}"
    return None


# ---- the KV cache in the kernels' order (csrc/kv_layout.h: KvLayout) --------------------------
def to_kernel_layout(k_cache, v_cache):
    """The same blocks reordered inside as the kernels keep them (K: kv_heads, head_dim / 2,
    block_size, 2; V: kv_heads, block_size / 2, head_dim, 2), each returned in the runner's shape
    (blocks, block_size, kv_heads, head_dim): for tests and for reading a cache in the paper's order.
    An int8 cache's rows end in their scale's 4 bytes: each head keeps its codes in that order, then
    its block_size scales."""
    import torch
    if k_cache.dtype != torch.int8:
        return _reorder(k_cache, v_cache)
    b, s, h, row = k_cache.shape
    codes = _reorder(k_cache[..., :-4].contiguous(), v_cache[..., :-4].contiguous())
    scales = [c[..., -4:].permute(0, 2, 1, 3).reshape(b, h, 4 * s) for c in (k_cache, v_cache)]
    k, v = (torch.cat([c.reshape(b, h, -1), sc], dim=-1).view(b, s, h, row) for c, sc in zip(codes, scales))
    return k, v


def _reorder(k_cache, v_cache):
    b, s, h, d = k_cache.shape
    k = k_cache.reshape(b, s, h, d // 2, 2).permute(0, 2, 3, 1, 4).contiguous().view(b, s, h, d)
    v = v_cache.reshape(b, s // 2, 2, h, d).permute(0, 3, 1, 4, 2).contiguous().view(b, s, h, d)
    return k, v


def from_kernel_layout(k_cache, v_cache):
    """The inverse of to_kernel_layout: blocks as (block_size, kv_heads, head_dim) again."""
    b, s, h, d = k_cache.shape
    k = k_cache.reshape(b, h, d // 2, s, 2).permute(0, 3, 1, 2, 4).reshape(b, s, h, d)
    v = v_cache.reshape(b, h, s // 2, d, 2).permute(0, 2, 4, 1, 3).reshape(b, s, h, d)
    return k, v
