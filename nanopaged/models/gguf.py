"""A GGUF file's quantized weights as they ship, for the 4- and 8-bit kernels (quantization="gguf").

The demo model ships as llama.cpp's GGUF format: each linear weight in blocks of 32 values along
its input axis, 4 bits a value plus a float16 scale (Q4_0: w = (q - 8) d) and a minimum (Q4_1:
w = q d + m). The converter (models/demo_model.py) dequantizes them once into a float32
safetensors folder; with quantization="gguf" the engine loads that folder as usual and then
puts the file's own 4-bit codes back under the linears (`nanopaged/cpu/quantized_linear.py: Int4Linear`):
Q4_1's w = q d + m is the kernel's (q - 8) scale + zero with scale = d and zero = m + 8 d.

Two things are undone on the way, as transformers' GGUF loader undoes them: llama.cpp stores its
llama family's q_proj and k_proj (`PERMUTED_ARCHS`) with the rows of each head's two rotary halves
interleaved (`unpermute_rows`), and it names tensors its own way (`GGUF_NAMES`). The output matrix (the lm_head; the
demo model ties it to the embeddings, `token_embd`) ships as Q8_0, 8 bits and a float16 scale per
block of 32, and runs as shipped too (`Q8Linear`), as do decoder linears a file stores as Q8_0
(a "Q8_0" GGUF's). A linear stored in any other type (F16, K-quants, ...), or whose stacked
parts mix 4- and 8-bit types, keeps the dequantized weights the folder holds, and is listed by
`load_gguf_linears`.

A mixture of experts ships as llama.cpp lays it out: each layer's experts stacked into one 3-D tensor
per projection (`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`: experts x rows x cols), beside the
router (`ffn_gate_inp`). transformers cannot make a folder of these (it reads no OLMoE file, reads a
Mixtral file, llama.cpp's "llama" with an expert count, as a dense Llama, and Qwen3-MoE without its
experts' width), so `moe_checkpoint` dequantizes them into the checkpoint the model ships as, each
expert's slice under its own name, and `load_gguf_linears` gives each expert its slice of the blocks.
"""
from __future__ import annotations

import numpy as np
import torch

from nanopaged.models.config import ModelConfig

BLOCK = 32                    # values per GGUF block, Q4_0, Q4_1 and Q8_0 alike
# our fused module -> the GGUF tensors whose rows it stacks, in order
GGUF_NAMES = {"self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"), "self_attn.o_proj": ("attn_output",),
              "mlp.gate_up_proj": ("ffn_gate", "ffn_up"), "mlp.down_proj": ("ffn_down",)}
# in a mixture of experts: each expert's fused module (models/moe.py: Expert) -> its slice of the stacked tensors
EXPERT_GGUF_NAMES = {"mlp.experts.*.gate_up_proj": ("ffn_gate_exps", "ffn_up_exps"),
                     "mlp.experts.*.down_proj": ("ffn_down_exps",)}
# llama.cpp's converter interleaves q's and k's rotary halves for its llama family alone (Llama, Mistral,
# Mixtral); Qwen's and OLMoE's rope already pairs the halves as Hugging Face does (transformers undoes "llama" only)
PERMUTED_ARCHS = ("llama",)


def q4_blocks(raw: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes (out, in) int32 in 0..15, scale (out, in / 32), zero (out, in / 32)) of a Q4_0 or
    Q4_1 tensor's raw bytes (out, blocks x bytes), with w = (q - 8) * scale + zero."""
    size = {"Q4_0": 18, "Q4_1": 20}[kind]
    out = raw.shape[0]
    blocks = raw.reshape(out, -1, size)
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q4_1":
        m, qs = blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32), blocks[:, :, 4:]
        zero = m + 8 * d
    else:
        qs, zero = blocks[:, :, 2:], np.zeros_like(d)
    # a block's 16 bytes: the low nibbles are its values 0..15, the high nibbles 16..31
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(out, -1).astype(np.int32)
    return codes, d, zero


def q8_blocks(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes (out, in) int32 in -128..127, scale (out, in / 32)) of a Q8_0 tensor's raw bytes
    (out, blocks x 34): a float16 scale d, then 32 signed bytes; w = q * d."""
    blocks = raw.reshape(raw.shape[0], -1, 34)
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    codes = blocks[:, :, 2:].copy().view(np.int8).reshape(raw.shape[0], -1).astype(np.int32)
    return codes, d


def unpermute_rows(n_rows: int, n_heads: int) -> np.ndarray:
    """The GGUF row each Hugging Face row of q_proj / k_proj comes from: llama.cpp's converter
    interleaves the two rotary halves of every head (transformers: reverse_permute_weights)."""
    return np.arange(n_rows).reshape(n_heads, n_rows // n_heads // 2, 2).swapaxes(2, 1).reshape(n_rows)


def load_gguf_linears(path: str, cfg: ModelConfig) -> tuple[dict, list[str]]:
    """{"model.layers.{i}.{module}": (codes, scale, zero)} for every fused linear whose tensors are
    all Q4_0/Q4_1, or (codes, scale) where they are all Q8_0, rows unpermuted and stacked as the
    module stacks them (a mixture's experts: `mlp.experts.{e}.gate_up_proj` and `.down_proj`, each
    its slice of the stacked tensors); "lm_head": (codes, scale) when the output matrix
    (`output.weight`, or the tied `token_embd.weight`) ships as Q8_0; and the names of the linears
    left dense (another type), for the load's log (a layer's experts once: they share a type)."""
    import gguf
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    if any(name.endswith("_exps.weight") for name in tensors):
        moe_arch(reader, path)
    permuted = field(reader, "general.architecture") in PERMUTED_ARCHS
    heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads} if permuted else {}
    found, dense = {}, []
    for i in range(cfg.num_hidden_layers):
        for module, parts in layer_gguf_names(tensors, i).items():
            ts = [tensors[f"blk.{i}.{p}.weight"] for p in parts]
            kinds = {t.tensor_type.name for t in ts}
            if not (kinds <= {"Q4_0", "Q4_1"} or kinds == {"Q8_0"}):     # one kernel for the stacked parts
                dense.append(f"model.layers.{i}.{module} ({', '.join(t.tensor_type.name for t in ts)})")
                continue
            experts = ts[0].data.shape[0] if "*" in module else None
            for e in range(experts) if experts else [None]:
                raws = [np.asarray(t.data if e is None else t.data[e]) for t in ts]
                found[f"model.layers.{i}.{module.replace('*', str(e))}"] = stacked_blocks(raws, ts, parts, heads)
    output = tensors.get("output.weight", tensors.get("token_embd.weight"))
    if output is not None and output.tensor_type.name == "Q8_0":
        found["lm_head"] = tuple(torch.from_numpy(a) for a in q8_blocks(np.asarray(output.data)))
    elif output is not None:
        dense.append(f"lm_head ({output.tensor_type.name})")
    return found, dense


def layer_gguf_names(tensors: dict, i: int) -> dict[str, tuple[str, ...]]:
    """Layer i's fused modules -> the GGUF tensors whose rows each stacks: the attention's, then the
    dense MLP's, or where the layer is a mixture of experts, the stacked tensors every expert slices."""
    if f"blk.{i}.ffn_gate_exps.weight" not in tensors:
        return GGUF_NAMES
    return {**{m: p for m, p in GGUF_NAMES.items() if m.startswith("self_attn.")}, **EXPERT_GGUF_NAMES}


def stacked_blocks(raws: list[np.ndarray], ts: list, parts: tuple[str, ...], heads: dict) -> tuple:
    """One fused module's blocks: each part's raw bytes (rows, bytes) read as codes and scales (and
    zeros), q's and k's rows unpermuted where `heads` says, the parts' rows stacked in order."""
    pieces = []
    for part, t, raw in zip(parts, ts, raws):
        kind = t.tensor_type.name
        blocks = q8_blocks(raw) if kind == "Q8_0" else q4_blocks(raw, kind)
        if part in heads:
            rows = unpermute_rows(raw.shape[0], heads[part])
            blocks = tuple(b[rows] for b in blocks)
        pieces.append(blocks)
    return tuple(torch.from_numpy(np.concatenate([p[j] for p in pieces])) for j in range(len(pieces[0])))


# ---- a mixture of experts' file, as the checkpoint its model ships as ----------------------
# GGUF architecture -> the Hugging Face class whose routing llama.cpp's graph computes for it
MOE_ARCHS = {"qwen3moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM", "llama": "MixtralForCausalLM"}
MODEL_TYPES = {"Qwen3MoeForCausalLM": "qwen3_moe", "OlmoeForCausalLM": "olmoe", "MixtralForCausalLM": "mixtral"}
# metadata (after "{arch}.") that asks for routing or attention this code does not compute: the values it does
# compute, and what the others ask for (the gating function 1 is softmax, a weight scale 0 means none)
REFUSED_KEYS = {"expert_shared_count": ((None, 0), "shared experts"),
                "expert_group_count": ((None, 0, 1), "grouped top-k routing"),
                "expert_gating_func": ((None, 1), "a router scored other than by softmax"),
                "expert_weights_scale": ((None, 0.0, 1.0), "scaled routing weights"),
                "attention.clamp_kqv": ((None,), "clipped q/k/v"),
                "rope.scaling.type": ((None, "none"), "rope scaling")}
# GGUF tensor -> the checkpoint's name: the model's own, then each layer's ("blk.{i}." -> "model.layers.{i}.");
# an expert's slice of a stacked tensor takes the expert's index for "*"
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
               "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.gate",
               "ffn_gate_exps": "mlp.experts.*.gate_proj", "ffn_up_exps": "mlp.experts.*.up_proj",
               "ffn_down_exps": "mlp.experts.*.down_proj"}
# Mixtral ships its MoE block and its experts' projections under names of its own (models/loader.py: RENAMED)
MIXTRAL_NAMES = {"mlp.": "block_sparse_moe.", "gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def field(reader, key: str, default=None):
    """A metadata value of the file (a number, a string, a list), or `default` where it has none; a float32
    as the decimal it was written from (rms_norm_eps 1e-06, not 9.99999997e-07)."""
    import gguf
    found = reader.fields.get(key)
    if found is None:
        return default
    value = found.contents()
    return float(str(np.float32(value))) if found.types == [gguf.GGUFValueType.FLOAT32] else value


def is_moe_file(path: str) -> bool:
    """Whether a GGUF file holds stacked experts (llama.cpp's `ffn_*_exps`)."""
    import gguf
    return any(t.name.endswith("_exps.weight") for t in gguf.GGUFReader(path).tensors)


def moe_arch(reader, path: str) -> str:
    """The Hugging Face class of a mixture of experts' file whose routing nanopaged computes; a ValueError
    naming the architecture, or the setting, it does not compute."""
    arch = field(reader, "general.architecture")
    if arch not in MOE_ARCHS:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is a mixture of experts nanopaged does not compute; it "
                         f"reads {', '.join(map(repr, MOE_ARCHS))} (llama.cpp's name for Mixtral is 'llama')")
    for key, (computed, what) in REFUSED_KEYS.items():
        value = field(reader, f"{arch}.{key}")
        if value not in computed:
            raise ValueError(f"{path}: {arch}.{key}={value!r} asks for {what}, which nanopaged does not compute")
    return MOE_ARCHS[arch]


def moe_config(reader, tensors: dict, cls: str) -> dict:
    """config.json's fields: llama.cpp's metadata under transformers' names, the experts' count and width
    read off the stacked tensors, and the routing llama.cpp's graph computes (it renormalises the chosen
    experts' weights for Qwen3-MoE and Mixtral, not for OLMoE)."""
    arch = field(reader, "general.architecture")
    key = lambda name, default=None: field(reader, f"{arch}.{name}", default)     # noqa: E731
    experts, width, _ = tensors["blk.0.ffn_gate_exps.weight"].data.shape         # (experts, rows, cols)
    hidden, heads = key("embedding_length"), key("attention.head_count")
    config = {"architectures": [cls], "model_type": MODEL_TYPES[cls], "dtype": "float32",
              "vocab_size": tensors["token_embd.weight"].data.shape[0], "hidden_size": hidden,
              "num_hidden_layers": key("block_count"), "num_attention_heads": heads,
              "num_key_value_heads": key("attention.head_count_kv", heads),
              "head_dim": key("attention.key_length", hidden // heads),
              "rms_norm_eps": key("attention.layer_norm_rms_epsilon"), "rope_theta": key("rope.freq_base", 10000.0),
              "max_position_embeddings": key("context_length"), "sliding_window": key("attention.sliding_window"),
              "tie_word_embeddings": "output.weight" not in tensors, "num_experts_per_tok": key("expert_used_count"),
              "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),
              "eos_token_id": field(reader, "tokenizer.ggml.eos_token_id"),
              "pad_token_id": field(reader, "tokenizer.ggml.padding_token_id")}
    if cls == "Qwen3MoeForCausalLM":      # its intermediate_size is a dense MLP's, which no layer of the file has
        return {**config, "num_experts": experts, "moe_intermediate_size": width, "norm_topk_prob": True,
                "intermediate_size": key("feed_forward_length", width), "mlp_only_layers": [], "decoder_sparse_step": 1}
    if cls == "OlmoeForCausalLM":
        return {**config, "num_experts": experts, "intermediate_size": width, "norm_topk_prob": False}
    return {**config, "num_local_experts": experts, "intermediate_size": width}


def checkpoint_name(name: str, cls: str) -> str | None:
    """The checkpoint's name of GGUF tensor `name` ("blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj.weight"),
    with "*" for an expert's index; None for a tensor the model has no place for."""
    parts = name.split(".")
    if len(parts) == 2 and parts[0] in TOP_NAMES and parts[1] == "weight":
        return f"{TOP_NAMES[parts[0]]}.weight"
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in LAYER_NAMES and parts[3] == "weight":
        module = LAYER_NAMES[parts[2]]
        for ours, theirs in MIXTRAL_NAMES.items() if cls == "MixtralForCausalLM" else ():
            module = module.replace(ours, theirs)
        return f"model.layers.{parts[1]}.{module}.weight"
    return None


def moe_checkpoint(path: str) -> tuple[dict, dict]:
    """A mixture of experts' GGUF file as the Hugging Face checkpoint it came from: config.json's fields
    and {name: float32 tensor}, each tensor dequantized, q's and k's rows unpermuted where llama.cpp
    permuted them, each expert's slice of a stacked tensor under that expert's own name. A ValueError
    for an architecture, setting or tensor this code does not compute, or a layer without experts."""
    import gguf
    from gguf.quants import dequantize
    reader = gguf.GGUFReader(path)
    cls = moe_arch(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    config = moe_config(reader, tensors, cls)
    for i in range(config["num_hidden_layers"]):      # llama.cpp writes every layer of these models as experts
        if f"blk.{i}.ffn_gate_exps.weight" not in tensors:
            raise ValueError(f"{path}: layer {i} has no experts (blk.{i}.ffn_gate_exps); nanopaged reads a mixture of "
                             f"experts' GGUF file whose every layer is one, as llama.cpp writes them")
    permuted = field(reader, "general.architecture") in PERMUTED_ARCHS
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]} if permuted else {}
    state = {}
    for name, t in tensors.items():
        target = checkpoint_name(name, cls)
        if target is None:
            raise ValueError(f"{path}: GGUF tensor {name!r} has no place in a {cls} as nanopaged computes it "
                             f"(shared experts, biases and extra tensors are not read)")
        w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)      # a copy: the file stays read-only
        part = name.split(".")[-2]
        if part in heads:
            w = w[unpermute_rows(w.shape[0], heads[part])]
        if "*" in target:
            state.update({target.replace("*", str(e)): torch.from_numpy(w[e].copy()) for e in range(w.shape[0])})
        else:
            state[target] = torch.from_numpy(w)
    return config, state
