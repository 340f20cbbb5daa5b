"""A hybrid model's two kinds of memory, as plain numbers (no torch): K/V that grows, and state that does not.

A hybrid (Qwen3.5: gated DeltaNet beside full attention; Granite 4.0-H: Mamba-2 beside attention) has
attention layers, whose K/V grows with every token, and linear (state-space) layers, which keep one fixed
state per request: a short convolution's last inputs and a recurrent matrix. The block pool pages both
from ONE pool of equal pages, as vLLM's hybrid KV cache manager does:

- the layers are cut into groups of as many layers as the model has attention layers: the attention
  layers are one group, the linear layers fill the others (the last padded);
- memory is one tensor per position in a group: position i is shared by attention layer i and by the
  i-th linear layer of every linear group;
- a page is one index into those tensors: for the attention group it holds a block of `block_size`
  tokens' K/V, for a linear group one request's state of that group's layers;
- the pages are equal: the block size is raised until a block of K/V is at least one layer's state
  (and to a multiple of the layers' chunk, so a block's end is a chunk's end).

So a request holds its block table (attention pages, growing) and one page per linear group (fixed), all
from the same free queue: memory spent on state is memory not spent on K/V, and the other way round.
docs/15_hybrid_models.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

STATE_BYTES_PER_VALUE = 4      # states are kept in float32: they are summed into at every token


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class HybridConfig:
    layer_types: tuple[str, ...]                   # "attention" or "linear", one per decoder layer
    state_shapes: tuple[tuple[int, ...], ...]      # one linear layer's state per request (float32 tensors)
    family: dict                                   # the family's own numbers (heads, dims, kernel, multipliers)
    chunk: int = 64                                # the linear layers' prompt chunk: blocks are a multiple of it

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "attention"]

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear"]

    @property
    def group_size(self) -> int:
        """Layers per group, and memory tensors: one per attention layer."""
        return len(self.attention_layers)

    @property
    def num_state_groups(self) -> int:
        """Pages one request's state takes: one per group of linear layers."""
        return cdiv(len(self.linear_layers), self.group_size)

    def state_bytes(self) -> int:
        """One linear layer's state for one request."""
        return sum(math.prod(shape) for shape in self.state_shapes) * STATE_BYTES_PER_VALUE

    def place(self, layer: int) -> tuple[int, int]:
        """(memory tensor, linear group) of a decoder layer; an attention layer's group is -1."""
        if self.layer_types[layer] == "attention":
            return self.attention_layers.index(layer), -1
        j = self.linear_layers.index(layer)
        return j % self.group_size, j // self.group_size

    def block_size_for(self, block_size: int, kv_bytes_per_token_per_layer: int) -> int:
        """The smallest block size, at least the one asked for and a multiple of the layers' chunk, whose K/V
        page of one layer holds one layer's state: then one page size serves both kinds (vLLM raises it the
        same way), and the state at every block boundary is one the chunked rule computes anyway."""
        need = max(block_size, cdiv(self.state_bytes(), kv_bytes_per_token_per_layer))
        return cdiv(need, self.chunk) * self.chunk


# What a hybrid does not run with yet, and why: refused by name before any weight loads.
HYBRID_REFUSALS = (
    ("tensor_parallel_size", lambda c: c.tensor_parallel_size > 1,
     "the linear layers' heads are not split across ranks"),
    ("speculative_config", lambda c: c.speculative_config is not None,
     "rejected drafts would have to roll each state back to before them, and a state keeps no history"),
    ("enable_lora", lambda c: c.enable_lora, "adapters have not been tested on the linear layers' projections"),
    ("runner", lambda c: c.runner == "pooling", "pooling has not been tested on a hybrid"),
    ("quantization", lambda c: c.quantization is not None, "no quantized path has been held to the reference"),
    ("kv_cache_dtype", lambda c: c.kv_cache_dtype != "auto", "8-bit K/V has not been tested in shared pages"),
    ("async_scheduling", lambda c: c.async_scheduling, "every step reads and writes the state pages; scheduling "
     "a step ahead has not been held to the reference with them"),
    ("attention_backend", lambda c: c.attention_backend not in ("auto", "torch"),
     "the K/V of a hybrid's pages sit beside its state; only the torch backend reads them there"),
    ("cpu_kernels", lambda c: c.cpu_kernels == "fused", "the fused C++ layer loop knows only attention layers"),
)


def check_hybrid(cfg, bytes_per_value: int) -> None:
    """An EngineConfig (config.py) of a hybrid: refuse what it does not run with yet; raise the block size
    until a block of one attention layer's K/V holds one linear layer's state (`block_size_for`)."""
    for name, refused, why in HYBRID_REFUSALS:
        if refused(cfg):
            raise ValueError(f"{name}={getattr(cfg, name)!r} is not supported with the hybrid model "
                             f"{cfg.model_config.architecture}: {why}")
    cfg.async_scheduling = False
    m = cfg.model_config
    cfg.block_size = m.hybrid.block_size_for(cfg.block_size, 2 * m.num_key_value_heads * m.head_dim * bytes_per_value)


def qwen3_5_hybrid(cfg: dict) -> HybridConfig:
    """Qwen3.5's gated DeltaNet layers, from its config.json (transformers' Qwen3_5TextConfig)."""
    n = cfg["num_hidden_layers"]
    interval = cfg.get("full_attention_interval", 4)
    types = cfg.get("layer_types") or ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                       for i in range(n)]
    if len(types) != n or set(types) - {"full_attention", "linear_attention"}:
        raise ValueError(f"'layer_types' must name {n} layers, each 'full_attention' or 'linear_attention', "
                         f"got {types!r}")
    if "full_attention" not in types:
        raise ValueError("a hybrid with no full-attention layer is not supported: its pages are sized by one")
    linear = {name: cfg.get(name, default) for name, default in (
        ("linear_num_key_heads", 16), ("linear_num_value_heads", 32), ("linear_key_head_dim", 128),
        ("linear_value_head_dim", 128), ("linear_conv_kernel_dim", 4))}
    for name, value in linear.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"field {name!r} must be a positive integer, got {value!r}")
    k_heads, v_heads = linear["linear_num_key_heads"], linear["linear_num_value_heads"]
    if v_heads % k_heads:
        raise ValueError(f"linear_num_value_heads={v_heads} must be a multiple of linear_num_key_heads={k_heads}")
    dk, dv = linear["linear_key_head_dim"], linear["linear_value_head_dim"]
    conv_dim = 2 * k_heads * dk + v_heads * dv              # q, k and v pass the short convolution together
    shapes = ((conv_dim, linear["linear_conv_kernel_dim"] - 1), (v_heads, dk, dv))
    return HybridConfig(tuple("attention" if t == "full_attention" else "linear" for t in types), shapes, linear)


def memory_figures(h: HybridConfig, kv_heads: int, head_dim: int, bytes_per_value: int, block_size: int,
                   num_pages: int, context: int = 4096) -> dict:
    """The two kinds of memory in bytes (get_stats()["hybrid"], the bench): what a token of context costs in
    the attention layers, what a request's state costs however long it is (as paged, and the bytes it fills),
    and how many requests of `context` tokens the pool holds at once."""
    page = 2 * block_size * kv_heads * head_dim * bytes_per_value * h.group_size     # one page, every position
    per_request = cdiv(context, block_size) + h.num_state_groups
    return {
        "page_bytes": page,
        "kv_bytes_per_token": page // block_size,
        "state_bytes_per_request": h.num_state_groups * page,
        "state_bytes_per_request_filled": len(h.linear_layers) * h.state_bytes(),
        "state_pages_per_request": h.num_state_groups,
        f"requests_at_{context}_tokens": num_pages // per_request,
    }


@dataclass(frozen=True)
class Mamba2Shape:
    hidden_size: int
    num_heads: int
    head_dim: int
    state_size: int                         # d_state: N, the width of B, C and the state
    n_groups: int                           # heads in a group share one B and one C (like GQA's K/V)
    conv_kernel: int                        # d_conv: the causal convolution's width
    chunk_size: int                         # the checkpoint's scan chunk (its training kernels')
    use_conv_bias: bool
    use_bias: bool                          # in_proj's and out_proj's
    time_step_limit: tuple[float, float]    # dt is clamped into it after the softplus
    rms_norm_eps: float

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        # the convolution runs over x, B and C together
        return self.intermediate_size + 2 * self.n_groups * self.state_size

    @property
    def scan_chunk(self) -> int:
        """The chunk ssd_chunked runs: at most 64 (a short prompt pads to a whole chunk, and a chunk's work grows
        with its square), dividing the checkpoint's so that every one of its chunk ends is one of ours."""
        return math.gcd(64, self.chunk_size)

    def conv_state_shape(self) -> tuple[int, int]:
        """One request's conv state (float32): the last conv_kernel - 1 inputs of each channel."""
        return (self.conv_dim, self.conv_kernel - 1)

    def ssm_state_shape(self) -> tuple[int, int, int]:
        """One request's SSM state h (float32)."""
        return (self.num_heads, self.head_dim, self.state_size)

    @classmethod
    def from_hf(cls, cfg: dict) -> Mamba2Shape:
        """The mixer's numbers from a granitemoehybrid config.json (its mamba_* keys), checked."""
        hidden, heads = cfg["hidden_size"], cfg.get("mamba_n_heads", 128)
        inner = cfg.get("mamba_expand", 2) * hidden
        head_dim = cfg.get("mamba_d_head", "auto")
        if head_dim == "auto":
            head_dim = inner // heads
        groups = cfg.get("mamba_n_groups", 1)
        if heads * head_dim != inner:
            raise ValueError(f"mamba_n_heads={heads} x mamba_d_head={head_dim} must equal "
                             f"mamba_expand x hidden_size = {inner}")
        if heads % groups:
            raise ValueError(f"mamba_n_groups={groups} must divide mamba_n_heads={heads}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={cfg['hidden_act']!r}: the Mamba-2 mixer computes only 'silu'")
        limit = cfg.get("time_step_limit") or (0.0, float("inf"))
        return cls(hidden_size=hidden, num_heads=heads, head_dim=head_dim,
                   state_size=cfg.get("mamba_d_state", 256), n_groups=groups,
                   conv_kernel=cfg.get("mamba_d_conv", 4), chunk_size=cfg.get("mamba_chunk_size", 256),
                   use_conv_bias=cfg.get("mamba_conv_bias", True), use_bias=cfg.get("mamba_proj_bias", False),
                   time_step_limit=(json_float(limit[0]), json_float(limit[1])), rms_norm_eps=cfg.get("rms_norm_eps", 1e-6))


def json_float(value) -> float:
    """A float from config.json; transformers writes infinity as {"__float__": "Infinity"}."""
    return float(value["__float__"] if isinstance(value, dict) else value)


# Granite's scalings (muP): the embeddings, each layer's residual branch, attention's scores, the logits
GRANITE_MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")


def granite_hybrid(cfg: dict) -> HybridConfig:
    """Granite 4.0-H's Mamba-2 layers (transformers' granitemoehybrid), from its config.json."""
    n = cfg["num_hidden_layers"]
    names = {"mamba": "linear", "linear_attention": "linear", "attention": "attention", "full_attention": "attention"}
    types = cfg.get("layer_types") or cfg.get("layers_block_type") or ["mamba"] * n
    if len(types) != n or set(types) - set(names):
        raise ValueError(f"'layer_types' must name {n} layers, each 'mamba' or 'attention', got {types!r}")
    if "attention" not in {names[t] for t in types}:
        raise ValueError("a hybrid with no attention layer is not supported: its pages are sized by one")
    if cfg.get("num_local_experts", 0):
        raise ValueError(f"num_local_experts={cfg['num_local_experts']}: Granite 4.0-H's mixtures of experts "
                         "(Tiny, Small) are not supported yet; its dense hybrids (H-Micro, H-1B, H-350M) are")
    if cfg.get("position_embedding_type") not in (None, "nope", "rope"):
        raise ValueError(f"position_embedding_type={cfg['position_embedding_type']!r}: only 'rope' or none")
    shape = Mamba2Shape.from_hf(cfg)
    family = {"mamba": shape, "rope": cfg.get("position_embedding_type") == "rope",
              "shared_intermediate_size": cfg.get("shared_intermediate_size", 1024),
              **{name: float(cfg.get(name) or 1.0) for name in GRANITE_MULTIPLIERS}}
    return HybridConfig(tuple(names[t] for t in types), (shape.conv_state_shape(), shape.ssm_state_shape()),
                        family, chunk=shape.scan_chunk)
