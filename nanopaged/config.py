"""EngineConfig: every engine setting, with vLLM's names, checked once in __post_init__.

A wrong value is a ValueError that names the setting, the value and what is allowed,
raised before a model is loaded or a byte of KV cache is allocated.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

DTYPES = {"auto": "auto", "float32": "float32", "float": "float32",
          "bfloat16": "bfloat16", "float16": "float16", "half": "float16"}
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash")
PREFIX_HASHES = ("sha256", "xxhash", "xxhash64")
CPU_KV_CACHE_BYTES = 1 << 30   # default KV budget on CPU (zeroing it takes ~3 s per GiB on a 2-core VM)


@dataclass
class EngineConfig:
    model: str
    dtype: str = "auto"                     # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"                    # auto: cuda if available, else cpu
    block_size: int = 16                    # tokens per KV block
    max_model_len: int | None = None        # default: the model's max_position_embeddings
    max_num_seqs: int = 256                 # running requests per step, at most
    max_num_batched_tokens: int | None = None  # token budget per step; default 2048 CPU / 8192 CUDA
    kv_cache_memory_bytes: int | None = None   # KV budget; default 1 GiB on CPU
    num_kv_blocks: int | None = None        # exact block count; overrides the memory budget
    gpu_memory_utilization: float = 0.9     # CUDA: share of GPU memory the engine may use
    enable_prefix_caching: bool = True
    prefix_hash: str = "sha256"             # block hash: sha256 | xxhash (xxh3_128) | xxhash64
    attention_backend: str = "auto"
    enforce_eager: bool = False             # CUDA: no CUDA graphs
    seed: int = 0                           # for requests sampled without their own seed

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        self.dtype = DTYPES[self.dtype]
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        _check_int("block_size", self.block_size, 1, 1024)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        _check_int("max_model_len", self.max_model_len, 1, None, optional=True)
        _check_int("max_num_seqs", self.max_num_seqs, 1, None)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1, None, optional=True)
        _check_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1, None, optional=True)
        _check_int("num_kv_blocks", self.num_kv_blocks, 1, None, optional=True)
        _check_int("seed", self.seed, None, None)
        if (not isinstance(self.gpu_memory_utilization, (int, float))
                or not 0 < self.gpu_memory_utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        for name in ("enable_prefix_caching", "enforce_eager"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.prefix_hash not in PREFIX_HASHES:
            raise ValueError(f"prefix_hash must be one of {PREFIX_HASHES}, got {self.prefix_hash!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                             f"got {self.attention_backend!r}")
        check_model_folder(self.model)

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "EngineConfig":
        """Like the constructor, but an unknown setting is a ValueError listing the known ones."""
        known = {f.name for f in fields(cls)} - {"model"}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine setting(s) {unknown}; known: {sorted(known)}")
        return cls(model=model, **kwargs)


def check_model_folder(model: str) -> None:
    folder = Path(model)
    if not folder.is_dir():
        raise ValueError(f"model folder {model!r} does not exist (nanopaged never downloads; "
                         "pass a local Hugging Face folder or nanopaged.DEMO_MODEL)")
    if not (folder / "config.json").is_file():
        raise ValueError(f"model folder {model!r} has no config.json")
    if not any(folder.glob("*.safetensors")):
        raise ValueError(f"model folder {model!r} has no *.safetensors weights")


def _check_int(name, value, lo, hi, optional=False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")
