"""What `LLM.generate` returns: vLLM's RequestOutput and CompletionOutput, as plain records.

Built by engine/output_processor.py (docs/api.md lists the fields).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's entry in `CompletionOutput.logprobs` (vLLM: vllm/logprobs.py)."""
    logprob: float
    rank: int                      # 1 = the most likely token
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One generated sequence of a request (vLLM: vllm/outputs.py)."""
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None = None   # per token, when SamplingParams.logprobs is set
    finish_reason: str | None = None     # "stop" (EOS, stop token or string) | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string; None for EOS

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0   # prompt tokens whose K/V came from the prefix cache
    # prompt_logprobs=k: per prompt token, None for the first, then {token: Logprob} for the
    # token itself and the k most likely in its place
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
