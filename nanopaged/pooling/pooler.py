"""The pooler: a pooling request's hidden states, chunk by chunk, become one vector, or one row per token.

It sits in the engine's token-selection seat (engine/llm_engine.py: TokenSelection). The runner
hands it every row of the step (`read_every_row`) and the model's "logits" are its hidden states
(the pooling extension took the lm_head off), so it sees each request's rows for the positions
[num_computed_tokens, + rows) of this step: `update` has not advanced the counter yet. A prompt
longer than the step's budget comes in several chunks (chunked prefill):

    LAST   the hidden state of the prompt's last token, in its final chunk
    MEAN   the sum over every chunk, divided by the prompt's length at the end
    CLS    the hidden state of position 0, in its first chunk
    ALL    every position's hidden state (the token tasks: token_embed, token_classify), chunk after chunk

Then the task's head (vLLM's pooler heads): embed normalises (and cuts to `dimensions`); classify,
score and token_classify apply a classifier's `score` linear and its activation (softmax or sigmoid,
as config.json says: pooling/config.py), unless the request says use_activation=False.
A request whose prompt is complete gets its vector, and one placeholder token in place of a sampled
one: it carries the request through `Scheduler.update` and `check_stop` (max_tokens=1) to its finish,
which frees its blocks. vLLM: vllm/model_executor/layers/pooler.py. docs/04_scheduler.md, "Pooling".
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from torch import nn

from nanopaged.core.request import Request, SampledToken
from nanopaged.pooling_params import TOKEN_TASKS
from nanopaged.worker.model_runner import ModelInput, ModelRunnerOutput

PLACEHOLDER = SampledToken(0)     # never shown: EmbeddingRequestOutput has no tokens
# a classifier's activations by name (pooling/config.py); "classify": vLLM's PoolerClassify
ACTIVATIONS = {"classify": lambda x: torch.sigmoid(x) if x.shape[-1] < 2 else torch.softmax(x, dim=-1),
               "sigmoid": torch.sigmoid, "identity": lambda x: x}


def read_every_row(out, inputs: ModelInput) -> None:
    """The runner's before_forward hook: every row of the step is read out, not only each request's
    last (mean pooling needs them all; the pooler takes what its type needs)."""
    inputs.sample_rows = list(range(len(inputs.input_ids)))
    inputs.sample_requests = [request for request, num_new in out.scheduled for _ in range(num_new)]


class Pooler:
    def __init__(self, config, classifier: nn.Module | None = None) -> None:
        """`config`: the PoolerConfig (pooling/config.py); `classifier`: a classification model's score head."""
        self.pooling_type, self.normalize, self.classifier = config.pooling_type, config.normalize, classifier
        self.activations = {"classify": config.classify_activation, "token_classify": config.classify_activation,
                            "score": config.score_activation}
        self.partial: dict[Request, torch.Tensor | list] = {}   # a request's vector so far (MEAN: its sum; ALL: rows)
        self.finished: dict[str, torch.Tensor] = {}        # request id -> its vector, this step only

    def __call__(self, runner_output: ModelRunnerOutput) -> dict[Request, list[SampledToken]]:
        hidden, start, done = runner_output.logits, 0, {}
        self.finished = {}                                  # the output processor took the last step's
        for request, rows in itertools.groupby(runner_output.requests):
            num_rows = len(list(rows))
            self._take(request, hidden[start:start + num_rows], request.num_computed_tokens)
            start += num_rows
            if request.num_computed_tokens + num_rows == request.num_prompt_tokens:
                self.finished[request.request_id] = self._finish(request)
                done[request] = [PLACEHOLDER]
        return done

    def _take(self, request: Request, rows: torch.Tensor, first: int) -> None:
        """Rows for positions [first, first + len(rows)) of the prompt."""
        last = first + rows.shape[0] == request.num_prompt_tokens
        if request.sampling_params.pooling_params.task in TOKEN_TASKS:
            # first == 0: a new prompt or a recomputed one (a token task's blocks never hit the prefix cache)
            assert first == 0 or request in self.partial, "rows continue only from the request's own chunks"
            self.partial[request] = (self.partial[request] if first > 0 else []) + [rows.float().clone()]
        elif self.pooling_type == "LAST" and last:
            self.partial[request] = rows[-1].float()
        elif self.pooling_type == "CLS" and first == 0:
            self.partial[request] = rows[0].float().clone()       # not a view keeping the step's rows
        elif self.pooling_type == "MEAN":
            # first == 0: a new prompt, or one recomputed after a preemption (no prefix cache with MEAN)
            assert first == 0 or request in self.partial, "a MEAN sum continues only from its own chunks"
            before = self.partial.get(request) if first > 0 else None
            self.partial[request] = rows.float().sum(0) + (0 if before is None else before)

    def _finish(self, request: Request) -> torch.Tensor:
        """The pooled vector (a token task: its rows), through the task's head, flat (processors.py)."""
        pooled, params = self.partial.pop(request), request.sampling_params.pooling_params
        if params.task in TOKEN_TASKS:
            pooled = torch.cat(pooled)                         # (num_prompt_tokens, hidden)
        elif self.pooling_type == "MEAN":
            pooled = pooled / request.num_prompt_tokens
        head = self._embed if params.task in ("embed", "token_embed") else self._classify
        return head(pooled, params).flatten().cpu()

    def _embed(self, pooled: torch.Tensor, params) -> torch.Tensor:
        """Cut to `dimensions`, then normalised as the request asks (vLLM's order); a token task row by row."""
        if params.dimensions is not None:
            pooled = pooled[..., :params.dimensions]
        normalize = self.normalize if params.normalize is None else params.normalize
        return F.normalize(pooled, p=2, dim=-1) if normalize else pooled

    def _classify(self, pooled: torch.Tensor, params) -> torch.Tensor:
        """The score head's logits, (num_labels,) or (tokens, num_labels), and the task's activation."""
        with torch.inference_mode():                        # as the forward pass: the rows are inference tensors
            logits = self.classifier(pooled)                # float32 (models/loader.py: ScoreHead)
        if params.use_activation is False:
            return logits
        return ACTIVATIONS[self.activations[params.task]](logits)

    # ---- the rest of the token-selection seat -------------------------------------------------
    def add(self, samples: list[Request]) -> None:
        pass

    def forget(self, request: Request) -> None:
        """Finished or aborted: nothing of it is kept."""
        self.partial.pop(request, None)
