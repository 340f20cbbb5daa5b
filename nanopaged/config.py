"""EngineConfig: every engine setting, with vLLM's names, checked once: the settings' schema.

A wrong value is a ValueError that names the setting, the value and what is allowed,
raised before a model is loaded or a byte of KV cache is allocated. The device, the dtype and
the sizes are resolved here, in `__post_init__`; the kernels are not: `cpu_linear`,
`cpu_kernels`, `attention_backend` and `batch_invariant` stay as the user named them, and the
runner asks `nanopaged/cpu/choose.py: choose` what they mean on this machine (which may compile
C++, which a settings check never does). Each table of choices lives with its users: the dtypes
and devices here, the prefix-cache hash functions with the block pool
(`nanopaged/core/block_pool.py: HASH_FUNCTIONS`), the attention backends beside them
(`nanopaged/attention/backends.py: ATTENTION_BACKENDS`);
the checks are `nanopaged/validation.py`'s. docs/settings.md says what each means.
vLLM's engine arguments that are not settings here are read by `nanopaged/vllm_compat.py`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

from nanopaged.attention.backends import ATTENTION_BACKENDS
from nanopaged.core.block_pool import HASH_FUNCTIONS
from nanopaged.cpu.features import auto_cpu_dtype
from nanopaged.models.config import ModelConfig
from nanopaged.models.demo_model import find_gguf
from nanopaged.models.hybrid import check_hybrid
from nanopaged.reasoning import check_reasoning_parser
from nanopaged.sampling_params import MAX_LOGPROBS
from nanopaged.validation import SEED_RANGE, check_bool, check_choice, check_range
from nanopaged.vllm_compat import engine_settings

# dtype name (aliases included) -> (torch dtype name, bytes per value)
DTYPES = {"float32": ("float32", 4), "float": ("float32", 4), "bfloat16": ("bfloat16", 2),
          "float16": ("float16", 2), "half": ("float16", 2)}
DEVICES = ("auto", "cpu", "cuda")
# kv_cache_dtype (vLLM's names, and int8) -> the cache's torch dtype; auto: the model's (docs/01, "An 8-bit KV cache")
KV_CACHE_DTYPES = {"auto": None, "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2",
                   "int8": "int8"}
# CPU linear kernels (cpu/linear.py): packed = oneDNN's bfloat16 kernel on weights reordered
# once at load, dpbf16 / amx = nanopaged's on AVX512-BF16's dot product / AMX's tiles, reference = F.linear.
CPU_LINEARS = ("auto", "packed", "dpbf16", "amx", "reference")
# CPU layer kernels: fused = each decoder layer in C++, the layer loop too (cpu/fused.py);
# reference = the model's torch ops.
CPU_KERNELS = ("auto", "fused", "reference")
# quantization of the decoder layers' linears on CPU (cpu/quantized_linear.py); w8a8: each row too, per token
QUANTIZATIONS = (None, "gguf", "int4", "int8", "w8a8")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
CPU_KV_CACHE_BYTES = 1 << 30   # default KV budget on CPU (zeroing it takes ~3 s per GiB on a 2-core VM)
MAX_NUM_BATCHED_TOKENS = {"cpu": 2048, "cuda": 8192}   # default token budget per step


@dataclass
class EngineConfig:
    model: str
    tokenizer: str | None = None            # a folder with the tokenizer files; default: the model folder
    dtype: str = "auto"                     # auto: bfloat16 on CUDA and on CPUs with bf16 matrix units, else float32
    device: str = "auto"                    # auto: cuda if available, else cpu
    block_size: int = 16                    # tokens per KV block
    max_model_len: int | None = None        # default: the model's max_position_embeddings
    max_num_seqs: int = 256                 # running sequences per step, at most
    max_num_batched_tokens: int | None = None  # token budget per step; default 2048 CPU / 8192 CUDA
    kv_cache_memory_bytes: int | None = None   # KV budget; default 1 GiB on CPU, measured on CUDA
    kv_cache_dtype: str = "auto"            # auto: the model's dtype; fp8 (= fp8_e4m3), fp8_e5m2, int8: 1 byte a value
    num_kv_blocks: int | None = None        # exact block count; overrides the memory budget
    gpu_memory_utilization: float = 0.9     # CUDA: share of GPU memory the engine may use
    enable_prefix_caching: bool = True
    prefix_hash: str = "sha256"             # block hash: sha256 | xxhash (xxh3_128)
    attention_backend: str = "auto"         # auto | torch | cpu | triton | flash (resolved by cpu/choose.py)
    enforce_eager: bool = False             # CUDA: no CUDA graphs
    seed: int = 0                           # for requests sampled without their own seed
    max_logprobs: int = MAX_LOGPROBS        # the most logprobs / prompt_logprobs a request may ask for
    reasoning_parser: str | None = None     # qwen3 | deepseek_r1: a constraint holds from the answer on (reasoning.py)
    cpu_threads: str | None = "auto"        # CPU: follow the free cores (cpu/thread_governor.py); None: torch's
    cpu_linear: str = "auto"                # CPU: packed (oneDNN) | dpbf16 | amx (nanopaged's) | reference (F.linear)
    cpu_kernels: str = "auto"               # CPU: fused (C++ layer kernels) | reference (torch ops); auto: fused with packed linears
    tensor_parallel_size: int = 1           # ranks sharing the model, 1/N of the heads each (extras/tensor_parallel/)
    enable_expert_parallel: bool = False    # a mixture of experts under tensor parallelism: E/N whole experts a rank
    pipeline_parallel_size: int = 1         # stages of layers, one rank each, batches in flight (extras/pipeline_parallel/)
    speculative_config: dict | None = None  # ngram, suffix or draft_model drafts, verified in one pass (spec_decode/)
    quantization: str | None = None         # CPU: gguf | int4 | int8 | w8a8 (cpu/quantized_linear.py); None: off
    quantization_group_size: int = 32       # int4 / int8: input features per scale (gguf: the file's 32)
    batch_invariant: bool | None = None     # a request's tokens never depend on its batch; None: where the kernels hold it
    disable_cascade_attn: bool = False      # cpu attention: rows sharing their first blocks read them once (same result)
    async_scheduling: bool | None = None    # schedule step N+1 while N computes (engine/overlap.py); None: where it pays
    enable_lora: bool = False               # LoRA adapters per request (lora/): vLLM's four settings
    max_loras: int = 1                      # adapters in one step, at most (their slots)
    max_lora_rank: int = 16                 # the largest adapter rank accepted
    max_cpu_loras: int | None = None        # adapters kept read in memory, least recently used evicted; None: max_loras
    runner: str = "generate"                # pooling: embeddings, prefill without sampling (pooling/); auto: generate
    pooler_config: dict | None = None       # pooling: {"pooling_type": LAST|MEAN|CLS, "normalize"}; None: the model's
    max_num_encoder_input_tokens: int | None = None   # images: encoder rows one step may compute (multimodal/)
    encoder_cache_size: int | None = None   # images: encoder rows kept for reuse; None for both: resolved per model
    allowed_local_media_path: str | None = None   # the one folder image paths and file:// URLs may be read from
    limit_mm_per_prompt: dict | None = None       # {"image": N}: images a prompt may hold (multimodal/media.py)
    kv_cache_disk_dir: str | None = None    # a folder: full KV blocks kept on disk by their chained hash (kv_disk/)
    kv_cache_disk_gb: float = 10.0          # the disk tier's bound; the least recently used files go first
    model_config: ModelConfig = field(init=False, repr=False)   # read from the model's config.json
    gguf_file: str | None = field(init=False, default=None)     # quantization="gguf": the file's path

    def __post_init__(self) -> None:
        check_choice("dtype", self.dtype, ("auto", *DTYPES))
        check_choice("device", self.device, DEVICES)
        check_choice("kv_cache_dtype", self.kv_cache_dtype, tuple(KV_CACHE_DTYPES))
        check_range("block_size", self.block_size, 1, 1024, integer=True)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        for name in ("max_model_len", "max_num_batched_tokens", "kv_cache_memory_bytes", "num_kv_blocks",
                     "max_num_encoder_input_tokens", "encoder_cache_size"):
            check_range(name, getattr(self, name), 1, integer=True, optional=True)
        check_range("max_num_seqs", self.max_num_seqs, 1, integer=True)
        check_range("seed", self.seed, *SEED_RANGE, integer=True)
        check_range("max_logprobs", self.max_logprobs, 0, MAX_LOGPROBS, integer=True)
        check_range("gpu_memory_utilization", self.gpu_memory_utilization, 0, 1, lo_open=True)
        for name in ("enable_prefix_caching", "enforce_eager", "disable_cascade_attn", "enable_lora",
                     "enable_expert_parallel"):
            check_bool(name, getattr(self, name))
        check_choice("prefix_hash", self.prefix_hash, tuple(HASH_FUNCTIONS))
        self.reasoning_parser = check_reasoning_parser(None if self.reasoning_parser == "" else self.reasoning_parser)
        check_choice("attention_backend", self.attention_backend, ("auto", *ATTENTION_BACKENDS))
        check_choice("cpu_threads", self.cpu_threads, (None, "auto"))
        check_choice("cpu_linear", self.cpu_linear, CPU_LINEARS)
        check_choice("cpu_kernels", self.cpu_kernels, CPU_KERNELS)
        check_range("tensor_parallel_size", self.tensor_parallel_size, 1, integer=True)
        check_range("pipeline_parallel_size", self.pipeline_parallel_size, 1, integer=True)
        check_choice("quantization", self.quantization, QUANTIZATIONS)
        check_choice("quantization_group_size", self.quantization_group_size, (32, 64, 128, 256))
        for name in ("batch_invariant", "async_scheduling"):
            if getattr(self, name) is not None:
                check_bool(name, getattr(self, name))
        check_media_settings(self)
        self.tokenizer = check_model_folder(self.model, self.tokenizer)
        self.model_config = ModelConfig.from_folder(self.model)
        self._resolve_defaults()
        check_tensor_parallel(self.model_config, self.tensor_parallel_size, self.device, self.enable_expert_parallel)
        if self.tensor_parallel_size > 1:
            if self.async_scheduling:
                raise ValueError("async_scheduling=True with tensor_parallel_size > 1 is not supported: the ranks' "
                                 "runner has not been tested on the model thread; leave async_scheduling unset")
            self.async_scheduling = False
        self.gguf_file = check_quantization(self)
        if self.model_config.hybrid:       # what it does not run with yet; its block size (models/hybrid.py)
            check_hybrid(self, DTYPES[self.dtype][1])
        # The extensions' settings (speculative_config, enable_lora and its three, runner and pooler_config)
        # are each extension's to check: the engine asks every registered one before any weight loads
        # (engine/extension.py: Extension.check_config).

    def _resolve_defaults(self) -> None:
        if self.device == "auto":
            self.device = "cuda" if _cuda_available() else "cpu"
        elif self.device == "cuda" and not _cuda_available():
            raise ValueError("device='cuda' but CUDA is not available (torch.cuda.is_available() is False)")
        if self.dtype == "auto":    # vLLM's CPU backend runs half precision as bfloat16, too
            self.dtype = "bfloat16" if self.device == "cuda" else auto_cpu_dtype()
        self.dtype = DTYPES[self.dtype][0]
        limit = self.model_config.max_position_embeddings
        if self.max_model_len is None:
            self.max_model_len = limit
        elif self.max_model_len > limit:
            raise ValueError(f"max_model_len={self.max_model_len} is larger than the model's "
                             f"max_position_embeddings={limit}")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = MAX_NUM_BATCHED_TOKENS[self.device]
        if self.device == "cpu" and self.kv_cache_memory_bytes is None:
            self.kv_cache_memory_bytes = CPU_KV_CACHE_BYTES     # on CUDA: measured by the runner

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "EngineConfig":
        """Like the constructor, but with vLLM's engine arguments too: each one nanopaged does not
        have as a setting is honoured, accepted where it changes nothing, or refused by name
        (nanopaged/vllm_compat.py); an unknown name is a ValueError listing the known ones."""
        own = {f.name for f in fields(cls) if f.init} - {"model"}
        if not set(kwargs) <= own or any(v is None for v in kwargs.values()):
            kwargs = engine_settings(kwargs, own)
        return cls(model=model, **kwargs)


def _cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


# ---- checks of the model folder and the machine ----------------------------------------
def check_model_folder(model: str, tokenizer: str | None = None) -> str:
    """The folders exist and hold what they must; returns the tokenizer's folder (vLLM's default:
    the model's)."""
    folder = Path(model)
    if not folder.is_dir():
        raise ValueError(f"model folder {model!r} does not exist (nanopaged never downloads; "
                         "pass a local Hugging Face folder or nanopaged.DEMO_MODEL)")
    if not (folder / "config.json").is_file():
        raise ValueError(f"model folder {model!r} has no config.json")
    if not any(folder.glob("*.safetensors")):
        raise ValueError(f"model folder {model!r} has no *.safetensors weights")
    what = "model folder" if tokenizer is None else "tokenizer folder"
    tokenizer = model if tokenizer is None else str(tokenizer) if isinstance(tokenizer, Path) else tokenizer
    if not isinstance(tokenizer, str) or not Path(tokenizer).is_dir():
        raise ValueError(f"tokenizer={tokenizer!r} is not a folder (nanopaged never downloads; pass a local "
                         "folder with the tokenizer files)")
    if not any((Path(tokenizer) / f).is_file() for f in TOKENIZER_FILES):
        raise ValueError(f"{what} {tokenizer!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    return tokenizer


def check_media_settings(cfg: "EngineConfig") -> None:
    """allowed_local_media_path names a folder ("" is vLLM's unset); limit_mm_per_prompt counts images
    (another modality only at 0, as vLLM scripts write to turn one off)."""
    if cfg.allowed_local_media_path == "":
        cfg.allowed_local_media_path = None
    path = cfg.allowed_local_media_path
    if path is not None and (not isinstance(path, str) or not Path(path).is_dir()):
        raise ValueError(f"allowed_local_media_path={path!r} is not a folder; give an existing folder, or None "
                         "to read no local files")
    limit = cfg.limit_mm_per_prompt
    if limit is None:
        return
    if not isinstance(limit, dict):
        raise ValueError(f"limit_mm_per_prompt must be a dict such as {{'image': 2}}, got {limit!r}")
    others = sorted(k for k, v in limit.items() if k != "image" and v != 0)
    if others:
        raise ValueError(f"limit_mm_per_prompt={limit!r}: nanopaged takes images only; {others} may only be 0")
    check_range("limit_mm_per_prompt['image']", limit.get("image"), 0, integer=True, optional=True)


def check_quantization(cfg: "EngineConfig") -> str | None:
    """Weight-only quantization runs on CPU, in one process, on layers whose inputs divide into
    groups; "gguf" needs the model's GGUF file, whose path this returns."""
    if cfg.model_config.shipped_int8 and cfg.quantization not in (None, "w8a8"):
        raise ValueError(f"the checkpoint ships int8 W8A8 weights (config.json's quantization_config): "
                         f"quantization must be None or 'w8a8', got {cfg.quantization!r}")
    if cfg.model_config.shipped_int8:
        cfg.quantization = "w8a8"          # the checkpoint's own scheme, as vLLM reads it from config.json
    if cfg.quantization is None:
        return None
    if cfg.device != "cpu" or cfg.tensor_parallel_size > 1:
        raise ValueError(f"quantization={cfg.quantization!r} runs on CPU in one process (its kernels are torch's "
                         f"CPU ops); got device={cfg.device!r}, tensor_parallel_size={cfg.tensor_parallel_size}")
    m, group = cfg.model_config, cfg.quantization_group_size
    widths = {"hidden_size": m.hidden_size, "intermediate_size": m.intermediate_size,
              "heads x head_dim": m.num_attention_heads * m.head_dim}
    if m.moe is not None:
        widths["moe_intermediate_size"] = m.moe.intermediate_size
    for name, width in widths.items():
        if cfg.quantization == "int4" and width % group:
            raise ValueError(f"quantization_group_size={group} must divide the model's {name}={width}")
        if cfg.quantization == "w8a8" and width % 16:         # its kernels read whole registers of 16
            raise ValueError(f"quantization='w8a8' needs the model's {name}={width} to be a multiple of 16")
    if cfg.quantization != "gguf":
        return None
    return find_gguf(cfg.model)


def check_tensor_parallel(m: ModelConfig, size: int, device: str, expert_parallel: bool = False) -> None:
    """Before any process starts: every rank must get whole heads and an equal share of the MLP
    (Megatron's split, the paper's section 4.6), an equal share of every expert's MLP too, or with
    expert parallelism an equal number of whole experts; and on CUDA a device of its own."""
    if expert_parallel and size == 1:
        raise ValueError("enable_expert_parallel=True needs tensor_parallel_size > 1 (it places the experts "
                         "across the tensor-parallel ranks); got tensor_parallel_size=1")
    if expert_parallel and m.moe is None:
        raise ValueError("enable_expert_parallel=True needs a mixture-of-experts model; this one is dense "
                         "(its config.json has no num_experts)")
    widths = {"num_attention_heads": m.num_attention_heads, "num_key_value_heads": m.num_key_value_heads}
    if m.moe is None or m.moe.dense_layers:       # some layer has a dense MLP of intermediate_size
        widths["intermediate_size"] = m.intermediate_size
    if expert_parallel:                           # E/N whole experts on each rank
        widths["num_experts"] = m.moe.num_experts
    elif m.moe is not None:                       # each expert is split as a dense MLP is
        widths["moe_intermediate_size"] = m.moe.intermediate_size
    for name, value in widths.items():
        if value % size:
            raise ValueError(f"tensor_parallel_size={size} must divide the model's {name}={value}")
    if device == "cuda" and size > 1:
        import torch
        if size > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={size} is larger than the {torch.cuda.device_count()} "
                             "CUDA devices here (one rank per device)")


def check_memory_fits(nbytes: int, device: str, what: str,
                      advice: str = "lower num_kv_blocks or kv_cache_memory_bytes") -> None:
    """A ValueError before allocating `nbytes` on `device` if they are not free there."""
    free = _free_memory(device)
    if free is not None and nbytes > free:
        raise ValueError(f"{what} needs {nbytes / 2**30:.2f} GiB but only {free / 2**30:.2f} GiB of {device} memory "
                         f"is free ({nbytes:,} bytes needed, {free:,} available); {advice}")


def _free_memory(device: str) -> int | None:
    """Bytes free on the device: CUDA's own count, or the kernel's MemAvailable; None if unknown."""
    if device == "cuda":
        import torch
        return torch.cuda.mem_get_info()[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
