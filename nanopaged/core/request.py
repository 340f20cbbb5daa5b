"""Request: the state of one sequence as the scheduler sees it. Plain data, no torch.

The whole scheduler runs on two counters (the seed article, section 2.5): `num_tokens`
(prompt + generated so far) and `num_computed_tokens` (how many of them already have K/V
in the cache). A step schedules `num_new_tokens` for a request to let the second counter
chase the first; a prompt, a chunk of a prompt, a decode step and a recomputation after
preemption are all the same thing seen through these two numbers (docs/04_scheduler.md).
Drafts only raise the target: `num_tokens_with_spec` adds vLLM's spec_token_ids, verified in one step.
So does a placeholder (async scheduling, engine/overlap.py): the token a step still computing will
sample, counted before it is known, so the next step can be scheduled meanwhile.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nanopaged.sampling_params import SamplingParams


PLACEHOLDER = -1        # the id of a token not sampled yet (engine/overlap.py fills it in before the model reads it)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"                # back in the waiting queue, K/V dropped
    FINISHED_STOPPED = "finished_stopped"  # EOS, a stop token or a stop string
    FINISHED_LENGTH = "finished_length"    # max_tokens (or the context) reached
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass(eq=False)  # identity equality: two requests are never "equal"
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int                       # effective limit, after clipping to max_model_len
    eos_token_ids: frozenset[int] = frozenset()
    prompt: str | None = None
    cache_salt: str | None = None         # mixed into the first block hash: no sharing across salts
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)       # the block table: logical i -> physical id
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of its full blocks of tokens
    num_cached_blocks: int = 0            # leading blocks of block_ids already named in the prefix cache
    status: RequestStatus = RequestStatus.WAITING
    num_cached_tokens: int = 0            # prefix-cache hit at its first admission (vLLM's meaning)
    num_preemptions: int = 0
    num_seqs: int = 1                     # seats it takes in max_num_seqs: n while n - 1 samples will fork off it
    spec_token_ids: list[int] = field(default_factory=list)  # draft tokens to verify in its next step
    num_output_placeholders: int = 0     # tokens sampled by a step still computing, ids not known yet
    extension_fields: dict = field(default_factory=dict)   # by name (vLLM's lora_request): Extension.prepare
    extra_keys: tuple = ()                # what else its K/V depend on (from extensions): prefix-cache keys
    state_pages: list[int] = field(default_factory=list)   # a hybrid's state: one page per linear group
    pending_snapshots: list[tuple[int, list[int]]] = field(default_factory=list)  # (block index, pages): the step
                                          # now running writes the state at those blocks' ends there
    encoder_inputs: list = field(default_factory=list)   # its images, in prompt order (core/encoder_cache.py)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        """The target `num_computed_tokens` chases: the tokens, then the placeholders or the drafts (vLLM's name)."""
        return self.num_tokens + self.num_output_placeholders + len(self.spec_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output (+ placeholders or drafts past the end), without building it all."""
        p, n = len(self.prompt_token_ids), self.num_tokens
        if end > n:
            ahead = [PLACEHOLDER] * self.num_output_placeholders + self.spec_token_ids
            return self.token_ids(start, n) + ahead[max(start - n, 0):end - n]
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def is_finished(self) -> bool:
        return self.status.finished


@dataclass
class SampledToken:
    """The token a step chose for a request, as the scheduler and the output processor see it."""
    token_id: int
    logprob: float = 0.0                  # of the token, in the model's raw distribution
    top_logprobs: list[tuple[int, float, int]] | None = None   # (token, logprob, rank) when logprobs=k
    parent: Request | None = None         # drawn from another request's logits row: fork off it first
