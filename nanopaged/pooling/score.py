"""LLM.score(data_1, data_2): how well each text of data_2 goes with data_1 (vLLM's LLM.score).

    1 -> 1, 1 -> N, N -> N   data_1 one text (or a list of one) is paired with every text of data_2;
                             a list of N pairs with data_2's N texts, in order
    a cross-encoder          a classifier of one label reads each pair joined as its tokenizer joins a
                             pair (tokenizer(text, text_pair)); its score head's logit through the
                             cross-encoder's activation (sigmoid unless config.json names another)
    an embedding model       the cosine similarity of the two texts' embeddings (each text embedded once)

Each answer is a ScoringRequestOutput; `pairs`, `pair_prompt` and `cosine` serve /score and /rerank too.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from nanopaged.pooling.embed import pool
from nanopaged.pooling.outputs import ScoringOutput, ScoringRequestOutput
from nanopaged.pooling_params import PoolingParams


def score(llm, data_1, data_2, truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
          pooling_params=None, lora_request=None) -> list[ScoringRequestOutput]:
    config = llm.llm_engine.config
    if config.runner != "pooling":
        raise ValueError(f"LLM.score needs a pooling model, and this LLM runs runner={config.runner!r}: load it "
                         "with LLM(model, runner='pooling') (vLLM: --runner pooling)")
    data_1, data_2 = pairs(data_1, data_2)
    if pooling_params is not None and not isinstance(pooling_params, PoolingParams):
        raise ValueError(f"pooling_params must be one PoolingParams, got {type(pooling_params).__name__}")
    params = pooling_params or PoolingParams()
    if truncate_prompt_tokens is not None:
        params = replace(params, truncate_prompt_tokens=truncate_prompt_tokens)
    if config.model_config.num_labels is None:
        return cosine_scores(llm, data_1, data_2, use_tqdm, params, lora_request)
    tokenizer = llm.get_tokenizer()
    prompts = [pair_prompt(tokenizer, a, b) for a, b in zip(data_1 * len(data_2) if len(data_1) == 1 else data_1,
                                                            data_2)]
    outputs = pool(llm, "LLM.score", "score", prompts, params, use_tqdm, lora_request)
    return [ScoringRequestOutput(o.request_id, ScoringOutput(o.pooled.item()), o.prompt_token_ids, o.finished,
                                 o.num_cached_tokens) for o in outputs]


def cosine_scores(llm, data_1, data_2, use_tqdm, params, lora_request):
    """Each text embedded once, then cosine(data_1's, data_2's) per pair; a pair's prompt_token_ids are the
    two prompts' with the pad token between them where the tokenizer has one (as vLLM shows them)."""
    embedded = pool(llm, "LLM.score", "embed", data_1 + data_2, params, use_tqdm, lora_request)
    firsts, seconds = embedded[:len(data_1)], embedded[len(data_1):]
    pad = llm.get_tokenizer().pad_token_id
    return [ScoringRequestOutput(f"{a.request_id}_{b.request_id}",
                                 ScoringOutput(cosine(a.pooled, b.pooled)),
                                 a.prompt_token_ids + ([] if pad is None else [pad]) + b.prompt_token_ids)
            for a, b in zip(firsts * len(seconds) if len(firsts) == 1 else firsts, seconds)]


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.float(), b.float(), dim=0).item()


def pairs(data_1, data_2, names: tuple[str, str] = ("data_1", "data_2")) -> tuple[list[str], list[str]]:
    """Both sides as lists of texts, their lengths 1 -> 1, 1 -> N or N -> N (vLLM's rule); a ValueError
    naming the side (`names`: the caller's names for them) otherwise."""
    sides = []
    for name, data in zip(names, (data_1, data_2)):
        texts = [data] if isinstance(data, str) else data
        if not isinstance(texts, (list, tuple)) or not texts or not all(isinstance(t, str) for t in texts):
            raise ValueError(f"{name} must be a text or a non-empty list of texts, got {data!r:.80}")
        sides.append(list(texts))
    if len(sides[0]) > 1 and len(sides[0]) != len(sides[1]):
        raise ValueError(f"{names[0]} has {len(sides[0])} texts and {names[1]} {len(sides[1])}: the lengths must be "
                         "1 -> 1, 1 -> N or N -> N")
    return sides[0], sides[1]


def pair_prompt(tokenizer, text_1: str, text_2: str) -> dict:
    """The pair as the tokenizer joins one (its special tokens, its pair template). truncate_prompt_tokens
    then keeps the joined prompt's last k tokens, as for any prompt (vLLM cuts the pair in the tokenizer
    call instead; nanopaged's API servers share one tokenizer between threads, and a truncating call
    changes its state)."""
    return {"prompt_token_ids": tokenizer(text=text_1, text_pair=text_2)["input_ids"]}
