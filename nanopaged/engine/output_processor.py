"""Output processing: the tokens of a step become text, logprobs and RequestOutputs.

Whether a request stops is decided here and nowhere else (`check_stop`): EOS and stop
tokens, stop strings (which need the detokenized text) and length, in vLLM's order and
with vLLM's `stop_reason`; an extension adds its own rule (Extension.stop, which the engine hands
over as `stop_rules`). The engine then takes the stopped requests out of the scheduler. The n samples
of one request (n > 1) are gathered into one RequestOutput, each step or only at the end,
whole or as what is new (SamplingParams.output_kind); with detokenize=False nothing is
decoded at all (text "", logprobs without decoded tokens).
vLLM: v1/engine/output_processor.py, v1/engine/detokenizer.py, v1/core/sched/utils.py.
docs/04_scheduler.md, "Stopping".
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from nanopaged.core.request import Request, RequestStatus, SampledToken
from nanopaged.engine.detokenizer import IncrementalDetokenizer, StopMatcher
from nanopaged.outputs import CompletionOutput, Logprob, RequestOutput
from nanopaged.sampling_params import RequestOutputKind
from nanopaged.sample.sampler import top_logprobs

# An extension's stop rule: has the request's output just become complete? (check_stop, rule 0)
StopRule = Callable[[Request], bool]
FINISH_REASONS = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                  RequestStatus.FINISHED_ABORTED: "abort"}


def check_stop(request: Request, detokenizer: IncrementalDetokenizer | None = None,
               stop_rules: Sequence[StopRule] = ()
               ) -> tuple[RequestStatus, int | str | None] | None:
    """Does the request stop with the token it just got? (status, stop_reason), or None.

    0. an extension's rule says the output is complete (`stop_rules`, a hook: each sees every
       token once; a constraint that has reached its end): "stop", as for EOS;
    1. EOS (unless ignore_eos) or a stop token id, once min_tokens are out (the sampler
       does not draw them before): "stop"; the token's text is left out of the output unless
       include_stop_str_in_output;
    2. a stop string the new text completes, once more than min_tokens tokens are out (as
       for EOS: the earliest is token min_tokens + 1): "stop", the text cut before it (after
       it with include_stop_str_in_output); it may span several tokens;
    3. max_tokens (clipped to the context by the input processor): "length".
    With a detokenizer, the token's text is added to it here, where rule 1 says whether it belongs.
    """
    params, token = request.sampling_params, request.output_token_ids[-1]
    ready = request.num_output_tokens >= params.min_tokens
    stop = None
    complete = [rule(request) for rule in stop_rules]      # not any(): every rule must see the token
    if any(complete) or (ready and not params.ignore_eos and token in request.eos_token_ids):
        stop = (RequestStatus.FINISHED_STOPPED, None)
    elif ready and token in params.stop_token_ids:
        stop = (RequestStatus.FINISHED_STOPPED, token)
    if detokenizer is not None and (stop is None or params.include_stop_str_in_output):
        new_chars = len(detokenizer.add(token))
        hit = params.stop and detokenizer.find_stop(new_chars, params.stop, params.include_stop_str_in_output)
        if hit and request.num_output_tokens > params.min_tokens:
            detokenizer.text = detokenizer.text[:hit[1]]
            return RequestStatus.FINISHED_STOPPED, hit[0]
    if stop is None and request.num_output_tokens >= request.max_tokens:
        stop = (RequestStatus.FINISHED_LENGTH, None)
    if stop is not None and detokenizer is not None:
        detokenizer.flush()
    return stop


@dataclass
class SampleState:
    """What the user sees of one sequence."""
    request: Request
    detokenizer: IncrementalDetokenizer | None     # None: detokenize=False
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent: tuple[int, int, int] = (0, 0, 0)        # output_kind=DELTA: tokens, characters, logprobs sent so far

    @property
    def text(self) -> str:
        return "" if self.detokenizer is None else self.detokenizer.text


class OutputProcessor:
    def __init__(self, tokenizer, stop_rules: Sequence[StopRule] = ()) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, list[SampleState]] = {}   # user request id -> its n samples
        self.samples: dict[Request, tuple[str, SampleState]] = {}
        self.prompt_logprobs: dict[str, list] = {}          # request id -> one entry per prompt token
        self.aborted: list[RequestOutput] = []              # final outputs the next step returns
        self.stop_rules: list[StopRule] = list(stop_rules)  # check_stop's rule 0: the engine's, or the caller's

    def add(self, samples: list[Request]) -> None:
        states = [SampleState(seq, self._detokenizer(seq)) for seq in samples]
        stops = samples[0].sampling_params.stop
        if stops and states[0].detokenizer is not None:      # one automaton per request, not per sample
            matcher = StopMatcher(stops)
            for s in states:
                s.detokenizer.matcher = matcher.fork()
        self.requests[samples[0].request_id] = states
        self.samples.update((s.request, (samples[0].request_id, s)) for s in states)
        if samples[0].sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs[samples[0].request_id] = [None]     # nothing scores the first token

    def process(self, sampled: dict[Request, list[SampledToken]], prompt_logits=()
                ) -> tuple[list[RequestOutput], list[tuple[Request, RequestStatus]]]:
        """The outputs of the requests that advanced, and the sequences that stop.
        `prompt_logits` (ModelRunnerOutput.prompt_logits) score prompt tokens (prompt_logprobs)."""
        for request, start, logits in prompt_logits:
            self._add_prompt_logprobs(request, start, logits)
        advanced, stopped = {}, []
        for request, tokens in sampled.items():
            request_id, state = self.samples[request]
            stop = self._take(request, state, tokens)
            if stop is not None:
                status, state.stop_reason = stop
                state.finish_reason = FINISH_REASONS[status]
                stopped.append((request, status))
            advanced[request_id] = True
        outputs = [self._output(request_id) for request_id in advanced if self._reports(request_id)]
        for o in outputs:
            if o.finished:
                self._forget(o.request_id)
        return outputs, stopped

    def _take(self, request: Request, state: SampleState, tokens: list[SampledToken]):
        """The step's tokens (scheduler.update has appended them), checked one at a time in order:
        a request stops at the first that stops it, and the tokens after it (accepted drafts) go,
        from the request and from `tokens` (what the step's observers count)."""
        del request.output_token_ids[len(request.output_token_ids) - len(tokens):]
        for i, sample in enumerate(tokens):
            request.output_token_ids.append(sample.token_id)
            state.cumulative_logprob += sample.logprob
            if sample.top_logprobs is not None:
                state.logprobs.append(self.logprob_dict(sample.top_logprobs, request.sampling_params.detokenize))
            stop = check_stop(request, state.detokenizer, self.stop_rules)
            if stop is not None:
                del tokens[i + 1:]
                return stop
        return None

    def _detokenizer(self, seq: Request) -> IncrementalDetokenizer | None:
        p = seq.sampling_params
        if not p.detokenize:
            return None
        return IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, p.skip_special_tokens,
                                      p.spaces_between_special_tokens)

    def _reports(self, request_id: str) -> bool:
        """FINAL_ONLY: a request's output only once all of its samples have finished."""
        states = self.requests[request_id]
        return (states[0].request.sampling_params.output_kind is not RequestOutputKind.FINAL_ONLY
                or all(s.finish_reason is not None for s in states))

    def abort(self, request_id: str) -> list[Request]:
        """Forget a request, keeping its final output ("abort"); its sequences not finished yet."""
        states = self.requests.get(request_id, [])
        unfinished = [s for s in states if s.finish_reason is None]
        for s in unfinished:
            s.finish_reason = "abort"
        if states:
            self.aborted.append(self._output(request_id))
        self._forget(request_id)
        return [s.request for s in unfinished]

    def _add_prompt_logprobs(self, request: Request, start: int, logits: torch.Tensor) -> None:
        """Logits at prompt positions start.. score prompt tokens start + 1..; a position seen
        before (the prompt recomputed after a preemption) is not added twice."""
        entries = self.prompt_logprobs[self.samples[request][0]]
        skip = len(entries) - 1 - start
        targets = request.prompt_token_ids[start + 1:start + 1 + logits.shape[0]]
        if skip >= len(targets):
            return
        logprobs = torch.log_softmax(logits[skip:].float(), dim=-1)
        k = request.sampling_params.prompt_logprobs
        tops = top_logprobs(logprobs, torch.tensor(targets[skip:], device=logprobs.device), [k] * logprobs.shape[0])
        entries += [self.logprob_dict(top, request.sampling_params.detokenize) for top in tops]

    def logprob_dict(self, top: list[tuple[int, float, int]], decode: bool) -> dict[int, Logprob]:
        """decode=False (detokenize=False): no decoded tokens, as vLLM leaves them None."""
        return {t: Logprob(lp, rank, self.tokenizer.decode([t]) if decode else None) for t, lp, rank in top}

    def request_id_of(self, request: Request) -> str | None:
        """The id of the user request a sequence belongs to (None once it is finished or aborted)."""
        return self.samples[request][0] if request in self.samples else None

    def _output(self, request_id: str) -> RequestOutput:
        states = self.requests[request_id]
        first = states[0].request
        return RequestOutput(
            request_id=request_id, prompt=first.prompt, prompt_token_ids=first.prompt_token_ids,
            outputs=[self._completion(i, s) for i, s in enumerate(states)],
            finished=all(s.finish_reason is not None for s in states),
            num_cached_tokens=first.num_cached_tokens,
            prompt_logprobs=list(self.prompt_logprobs[request_id]) if request_id in self.prompt_logprobs else None)

    def _completion(self, index: int, s: SampleState) -> CompletionOutput:
        p = s.request.sampling_params
        wants_logprobs = p.logprobs is not None
        tokens, text, logprobs = s.request.output_token_ids, s.text, s.logprobs
        if p.output_kind is RequestOutputKind.DELTA:       # what is new since the last output
            # hold back the characters that may yet begin a stop string (vLLM: stop_buffer_length)
            cut = p.stop and not p.include_stop_str_in_output and s.finish_reason is None
            (t, c, lp) = s.sent
            end = max(c, len(text) - (max(map(len, p.stop)) - 1 if cut else 0))
            s.sent = (len(tokens), end, len(logprobs))
            tokens, text, logprobs = tokens[t:], text[c:end], logprobs[lp:]
        return CompletionOutput(
            index=index, text=text, token_ids=list(tokens),
            cumulative_logprob=s.cumulative_logprob if wants_logprobs else None,   # vLLM: None unless asked
            logprobs=list(logprobs) if wants_logprobs else None,
            finish_reason=s.finish_reason, stop_reason=s.stop_reason)

    def _forget(self, request_id: str) -> list[SampleState]:
        self.prompt_logprobs.pop(request_id, None)
        states = self.requests.pop(request_id, [])
        for s in states:
            self.samples.pop(s.request, None)
        return states
