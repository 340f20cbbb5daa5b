"""StructuredOutputManager: compiled grammars, one matcher per sequence, and the engine's two hooks.

    prepare     when a request is processed (before it is queued; the server's input threads): compile
                its constraint, once per text (a cache), or a ValueError that names what is wrong
    __call__    a logits processor of the sampler: the bitmask of every constrained row of the step,
                filled in one backend call and applied in one tensor operation (bitmask.py)
    ended       a stop rule of check_stop: the sequence's matcher accepts the token it just got;
                True once the grammar has reached its end (the request then stops: "stop")
    forget      the sequence is finished: its matcher goes

A matcher is made the first time its sequence samples, on the engine thread, from the compiled
grammar, and follows the sequence's tokens: it has accepted exactly `output_token_ids`, which a
preemption (recompute) does not change, so it is kept; each of n > 1 samples has its own.

Drafts (speculative decoding) never move it for good. `forced_drafts` and `allowed_drafts` try
tokens on the matcher and roll it back before they return; a verify step's row j (after drafts
d_1..d_j, a view of the request: sample/rejection_sampler.py: with_output) is masked by accepting
d_1..d_j, filling the row, and rolling back. Only `ended` (the stop rule, token by token as the
output processor appends them) advances it, so it advances by the accepted tokens alone.

With a reasoning parser (EngineConfig.reasoning_parser; nanopaged/reasoning.py) the constraint holds
the answer only: a sequence's matcher starts after the token that closes its reasoning (or at once,
if the prompt closed it); until then its rows are not masked and no draft is forced.
vLLM: vllm/v1/structured_output/__init__.py (StructuredOutputManager). docs/10_structured_outputs.md.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future

import torch

from nanopaged.core.request import Request
from nanopaged.reasoning import AnswerStart
from nanopaged.structured_output.backend_types import GrammarMatcher, StructuredOutputBackend
from nanopaged.structured_output.bitmask import apply_token_bitmask
from nanopaged.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)
# Compiled grammars kept, the least recently used dropped first (a server meets endless schemas;
# one compiled JSON schema over a 49k vocabulary holds tens of kilobytes).
MAX_CACHED_GRAMMARS = 256


class SequenceMatcher:
    """One sequence's place in its grammar: the backend's matcher and how many of its tokens it has seen."""

    def __init__(self, matcher: GrammarMatcher, answer: AnswerStart | None = None) -> None:
        self.matcher = matcher
        self.num_accepted = 0               # output tokens read: accepted, or (before the answer) scanned
        self.rejected: int | None = None    # a token the grammar refused (the mask makes that impossible)
        self.answer = answer                # None: the constraint holds from the first token
        self.tail = ""                      # the decoded end of the reasoning so far, for the end tag

    @property
    def answering(self) -> bool:
        return self.answer is None

    def follow(self, request: Request) -> None:
        """Accept the tokens the sequence got since the last call (those of its answer)."""
        while not self.answering and self.num_accepted < request.num_output_tokens:
            closed, self.tail = self.answer.scan(self.tail, request.output_token_ids[self.num_accepted])
            self.num_accepted += 1
            if closed:
                self.answer = None
        while self.num_accepted < request.num_output_tokens and self.rejected is None:
            token = request.output_token_ids[self.num_accepted]
            if not self.matcher.accept_token(token):
                self.rejected = token
                logger.warning("request %r: the grammar refuses token %d after %d tokens; the request stops",
                               request.request_id, token, self.num_accepted)
            self.num_accepted += 1

    @property
    def ended(self) -> bool:
        return self.rejected is not None or self.matcher.is_terminated()

    def try_tokens(self, tokens: list[int]) -> int:
        """Accept `tokens` in order up to the first the grammar refuses (or its end); how many it took.
        The caller rolls them back."""
        taken = 0
        for token in tokens:
            if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                break
            taken += 1
        return taken


class StructuredOutputManager:
    def __init__(self, backend: StructuredOutputBackend, reasoning_parser: str | None = None, tokenizer=None) -> None:
        self.backend = backend
        self.reasoning_parser, self.tokenizer = reasoning_parser, tokenizer    # the answer's start (reasoning.py)
        self.grammars: OrderedDict[tuple, Future] = OrderedDict()   # (kind, text, any_whitespace) -> compiled
        self.lock = threading.Lock()
        self.matchers: dict[Request, SequenceMatcher] = {}
        # what it cost, for bench.py: seconds spent masking and accepting, and every compile
        self.mask_seconds = self.accept_seconds = 0.0
        self.compiles: list[tuple[str, float]] = []         # (kind, seconds), one per compiled text

    # ---- requests in (any thread) -----------------------------------------------------------
    def prepare(self, samples: list[Request]) -> None:
        """Compile the request's constraint now, so no step waits for it; a ValueError if it cannot be."""
        self.grammar(samples[0].sampling_params.structured_outputs)

    def grammar(self, params: StructuredOutputsParams):
        """The compiled grammar of a constraint, compiled once per text. Threads asking for one that is
        being compiled wait for it rather than compiling it again."""
        kind, text = params.constraint()
        key = (kind, text, not params.disable_any_whitespace)
        with self.lock:
            future = self.grammars.get(key)
            mine = future is None
            if mine:
                future = self.grammars[key] = Future()
            self.grammars.move_to_end(key)
            while len(self.grammars) > MAX_CACHED_GRAMMARS:
                self.grammars.popitem(last=False)
        if mine:
            self._compile(key, params, future)
        return future.result()

    def _compile(self, key: tuple, params: StructuredOutputsParams, future: Future) -> None:
        kind, text, any_whitespace = key
        start = time.perf_counter()
        try:
            compiled = self.backend.compile_grammar(kind, text, any_whitespace)
        except BaseException as e:            # whatever it is, the threads waiting on it must hear of it
            error = e
            if isinstance(e, ValueError):     # the user's mistake: say which constraint it is
                error = ValueError(f"{_named(params, kind, text)} cannot be followed: {e}")
            with self.lock:                   # a bad constraint is not cached: the next one says so again
                if self.grammars.get(key) is future:
                    del self.grammars[key]
            future.set_exception(error)
            return
        self.compiles.append((kind, time.perf_counter() - start))
        future.set_result(compiled)

    # ---- the step's hooks (the engine thread) ---------------------------------------------------
    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """The sampler's logits processor: the step's logits with every constrained row masked. A row
        of a view past the request's tokens (a verify step's row after drafts, a draft model's step)
        is masked where those drafts lead; one whose drafts end the grammar is left as it is (the
        stop rule ends the request at that end: nothing it chooses there is kept)."""
        start = time.perf_counter()
        plain, ahead = [], []             # (row, state), (row, state, drafts before the row)
        for i, r in enumerate(requests):
            if r.sampling_params.structured_outputs is None:
                continue
            real = getattr(r, "view_of", r)
            state = self._matcher(real)
            if state.ended or not state.answering:    # stopping, or still reasoning: nothing to mask
                continue
            drafts = r.output_token_ids[real.num_output_tokens:]
            if drafts:
                ahead.append((i, state, drafts))
            else:
                plain.append((i, state))
        if not plain and not ahead:
            return logits
        bitmask = torch.empty(len(plain) + len(ahead), (self.backend.vocab_size + 31) // 32, dtype=torch.int32)
        if plain:                         # one call for the rows at the sequences' own tokens
            self.backend.fill_bitmask([state.matcher for _, state in plain], bitmask)
        rows, filled = [i for i, _ in plain], list(range(len(plain)))
        for row, (i, state, drafts) in enumerate(ahead, start=len(plain)):
            taken = state.try_tokens(drafts)
            if not state.matcher.is_terminated():
                state.matcher.fill_row(bitmask, row)    # a refused draft: the mask where it was refused
                rows.append(i)
                filled.append(row)
            state.matcher.rollback(taken)
        if not rows:
            return logits
        if len(filled) < len(bitmask):
            bitmask = bitmask[filled]
        logits = apply_token_bitmask(logits, bitmask, rows)
        self.mask_seconds += time.perf_counter() - start
        return logits

    # ---- drafts (speculative decoding: spec_decode/drafter.py) --------------------------------
    def forced_drafts(self, request: Request, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces next. The text every allowed output goes on with
        (xgrammar's jump-forward string) in the model's tokens, less its last token (which the model
        may merge with the free text after it: '"' before ':' is '":'), and a token that is the only
        one allowed (the stop token after a complete output). Each passes the matcher, rolled back after."""
        state = self._matcher(request)
        if state.ended or not state.answering:
            return []
        drafts: list[int] = []
        bitmask = torch.empty(1, (self.backend.vocab_size + 31) // 32, dtype=torch.int32)
        while len(drafts) < limit and not state.matcher.is_terminated():
            text = state.matcher.forced_text()
            guess = self.backend.encode(text)[:-1] if text else []
            if not guess:
                state.matcher.fill_row(bitmask, 0)
                guess = only_token(bitmask[0])
            taken = state.try_tokens(guess[:limit - len(drafts)])
            drafts += guess[:taken]
            if taken < len(guess) or taken == 0:
                break
        state.matcher.rollback(len(drafts))
        return drafts

    def allowed_drafts(self, request: Request, before: list[int], drafts: list[int]) -> list[int]:
        """The longest start of `drafts` the grammar allows after `before` (drafts it allows)."""
        state = self._matcher(request)
        if state.ended:
            return []
        if not state.answering:           # reasoning: free text, whatever the drafts
            return drafts
        taken = state.try_tokens(before)
        allowed = state.try_tokens(drafts) if taken == len(before) else 0
        state.matcher.rollback(taken + allowed)
        return drafts[:allowed]

    def ended(self, request: Request) -> bool:
        """check_stop's rule: accept the sequence's new token; has its grammar reached its end?"""
        if request.sampling_params.structured_outputs is None:
            return False
        start = time.perf_counter()
        ended = self._matcher(request).ended
        self.accept_seconds += time.perf_counter() - start
        return ended

    def forget(self, request: Request) -> None:
        self.matchers.pop(request, None)

    def _matcher(self, request: Request) -> SequenceMatcher:
        """The sequence's matcher (made on first use), caught up with its tokens."""
        state = self.matchers.get(request)
        if state is None:
            compiled = self.grammar(request.sampling_params.structured_outputs)   # cached since prepare
            state = self.matchers[request] = SequenceMatcher(self.backend.matcher(compiled), self._answer(request))
        state.follow(request)
        return state

    def _answer(self, request: Request) -> AnswerStart | None:
        """Where a new sequence's answer is looked for, or None: the constraint holds from its first token."""
        if self.reasoning_parser is None:
            return None
        answer = AnswerStart(self.reasoning_parser, self.tokenizer)
        return None if answer.closed_in_prompt(request.prompt_token_ids) else answer


def only_token(row: torch.Tensor) -> list[int]:
    """[t] if bit t is the only bit set in a bitmask row (int32 words, 32 tokens each), else []."""
    words = row.nonzero()
    if len(words) != 1:
        return []
    w = int(words[0])
    bits = int(row[w]) & 0xFFFFFFFF
    if bits & (bits - 1):
        return []
    return [32 * w + bits.bit_length() - 1]


def _named(params: StructuredOutputsParams, kind: str, text: str) -> str:
    """How an error names the constraint: the field, and the value when it is short enough to read."""
    name = params.describe()
    if name in ("structured_outputs.regex", "structured_outputs.grammar") and len(text) <= 200:
        return f"{name}={text!r}"
    return name
