"""Logits processors: what changes a step's logits before a token is chosen.

The sampler (sampler.py: Sampler.process_logits) applies two kinds, in vLLM's order:

  the extensions' processors  each extension's `process_logits` (engine/extension.py; structured
                              outputs' grammar mask): first, before the logprobs are taken, as vLLM
                              applies its grammar bitmask before its sampler
  SamplingParams' own rules   after the logprobs, in vLLM's order (v1/sample/sampler.py):
                              allowed_token_ids, bad_words, logit_bias; then the penalties;
                              then min_tokens (EOS and stop tokens blocked before it)

A row whose request sets none of a rule's fields leaves that rule's tensors untouched.
"""
from __future__ import annotations

from typing import Protocol

import torch

from nanopaged.core.request import Request


class LogitsProcessor(Protocol):
    """An extension's processor (Extension.process_logits): row i of `logits` is requests[i]'s."""

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """The logits to sample from, leaving the tensor it is given as it was."""


def apply_sampling_rules(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """SamplingParams' own rules, each only where some row of the step asks for it."""
    params = [r.sampling_params for r in requests]
    if any(p.allowed_token_ids or p.bad_words_token_ids or p.logit_bias for p in params):
        logits = apply_token_rules(logits, requests)
    if any(p.has_penalties for p in params):
        logits = apply_penalties(logits, requests)
    if any(r.num_output_tokens < r.sampling_params.min_tokens for r in requests):
        logits = block_stop_tokens(logits, requests)
    return logits


def indices(like: torch.Tensor, xs: list[int]) -> torch.Tensor:
    """An index tensor on the device of `like`."""
    return like.new_tensor(xs, dtype=torch.long)


def apply_token_rules(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """vLLM's three, in its order (v1/sample/sampler.py): allowed_token_ids leaves only those tokens;
    bad_words blocks a word's last token when the output ends with the word's other tokens (a
    one-token word always; v1/sample/ops/bad_words.py); logit_bias adds to the logits."""
    blocked = torch.zeros_like(logits, dtype=torch.bool)
    allow_rows, allow_toks, block_rows, block_toks, bias_rows, bias_toks, biases = [], [], [], [], [], [], []
    for j, r in enumerate(requests):
        p = r.sampling_params
        if p.allowed_token_ids:
            blocked[j] = True
            allow_rows += [j] * len(p.allowed_token_ids)
            allow_toks += p.allowed_token_ids
        for *start, last in p.bad_words_token_ids or ():
            if len(start) <= r.num_output_tokens and r.output_token_ids[r.num_output_tokens - len(start):] == start:
                block_rows.append(j)
                block_toks.append(last)
        for token, bias in (p.logit_bias or {}).items():
            bias_rows.append(j)
            bias_toks.append(token)
            biases.append(bias)
    blocked[indices(logits, allow_rows), indices(logits, allow_toks)] = False
    blocked[indices(logits, block_rows), indices(logits, block_toks)] = True
    logits = logits.masked_fill(blocked, float("-inf"))
    return logits.index_put_((indices(logits, bias_rows), indices(logits, bias_toks)),
                             logits.new_tensor(biases), accumulate=True)


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """vLLM's penalties; a row without penalties is left exactly as it was."""
    out_rows, out_toks, seen_rows, seen_toks = [], [], [], []
    for j, r in enumerate(requests):
        out_rows += [j] * r.num_output_tokens
        out_toks += r.output_token_ids
        seen_rows += [j] * r.num_prompt_tokens
        seen_toks += r.prompt_token_ids
    counts = logits.new_zeros(logits.shape)           # new_*: on the logits' device
    counts.index_put_((indices(logits, out_rows), indices(logits, out_toks)),
                      logits.new_ones(len(out_toks)), accumulate=True)
    seen = counts > 0
    seen[indices(logits, seen_rows), indices(logits, seen_toks)] = True
    p = [r.sampling_params for r in requests]
    rep = logits.new_tensor([x.repetition_penalty for x in p])[:, None]
    pres = logits.new_tensor([x.presence_penalty for x in p])[:, None]
    freq = logits.new_tensor([x.frequency_penalty for x in p])[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    return logits - freq * counts - pres * (counts > 0).float()


def block_stop_tokens(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Before min_tokens, EOS (unless ignore_eos) and stop_token_ids get probability 0."""
    rows, toks = [], []
    for j, r in enumerate(requests):
        p = r.sampling_params
        if r.num_output_tokens < p.min_tokens:
            stop = set(p.stop_token_ids) | (set() if p.ignore_eos else set(r.eos_token_ids))
            rows += [j] * len(stop)
            toks += sorted(stop)
    logits = logits.clone()
    logits[indices(logits, rows), indices(logits, toks)] = float("-inf")
    return logits
