"""The trace every engine runs (nano-vllm's), the warm-up prompt before it, and `Run`, what
one engine's timed generation of it yields."""
from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class Trace:
    prompts: list[list[int]]     # token ids
    output_lens: list[int]       # tokens each request must generate (ignore_eos)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_trace(num_requests: int, input_len, output_len, seed: int, vocab_limit: int) -> Trace:
    """nano-vllm's trace: random token ids and uniform lengths, all from one seeded generator."""
    rng = random.Random(seed)
    prompts = [random_ids(rng, rng.randint(*input_len), vocab_limit) for _ in range(num_requests)]
    return Trace(prompts, [rng.randint(*output_len) for _ in range(num_requests)])


def trace_settings(args) -> dict:
    """The trace flags of a run, as the settings in its JSON name them."""
    return {"num_requests": args.num_requests, "input_len": list(args.input_len),
            "output_len": list(args.output_len), "seed": args.seed}


def random_ids(rng: random.Random, n: int, vocab_limit: int) -> list[int]:
    """`n` random token ids from 3 (no special token) below `vocab_limit` (the model's and tokenizer's)."""
    return [rng.randrange(3, vocab_limit) for _ in range(n)]


# Every engine warms up on this prompt: ids 3..18 start no random prompt, so the warm-up
# leaves nothing in a prefix cache that the trace could hit.
WARMUP_PROMPT = {"prompt_token_ids": list(range(3, 19))}


@dataclass
class StepTiming:
    """One engine step as the roofline sees it: its rows, tokens, context and forward time."""
    num_rows: int                # requests in the step
    num_tokens: int              # new tokens computed (a decode-only step: one per row)
    context_tokens: int          # sum over rows of the context each row attends over
    model_s: float               # the forward pass and sampling (StepRecord.times[2] - [1])
    num_sampled: int = 0         # rows that sampled a token (each needs the lm_head)
    attention_pairs: int = 0     # (query, key) pairs attention computes, causal


@dataclass
class Run:
    """One engine's timed generation."""
    name: str
    wall_s: float
    output_tokens: int           # only the tokens each request asked for
    prompt_tokens: int
    num_requests: int
    extra: dict
    steps: list = field(default_factory=list, repr=False)   # StepTiming per step (nanopaged only)
    token_ids: list = field(default_factory=list, repr=False)   # each request's output (nanopaged only)

    def figures(self) -> dict:
        return {"output_tokens_per_s": self.output_tokens / self.wall_s,
                "total_tokens_per_s": (self.output_tokens + self.prompt_tokens) / self.wall_s,
                "requests_per_s": self.num_requests / self.wall_s,
                "wall_s": self.wall_s, "output_tokens": self.output_tokens,
                "prompt_tokens": self.prompt_tokens, **self.extra}
