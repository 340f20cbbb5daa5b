"""Beam search on shared blocks (paper section 4.4, "beam search").

Every beam is an engine Request. The search drives the engine through its public step
(`LLMEngine.step(select_tokens)`) with its own token-selection rule, which records each
beam's best next tokens instead of sampling; the search then picks the next beams itself.
A beam that survives a step with several continuations forks (Scheduler.fork): the
children share all of its blocks, and copy-on-write gives each a private copy of the partly
filled last block when it writes into it. A beam with no surviving continuation is
finished, and its blocks go back unless another beam still holds them. So beams that share
a long history share its K/V, which is where the paper's 37.6-55.2% memory saving for beam
search comes from. docs/06_sharing.md explains it.

The search rule is Hugging Face transformers' beam search (`generate(num_beams=k,
do_sample=False, length_penalty=..., early_stopping=False)`, transformers 5.x
generation/utils.py `_beam_search`), step for step:
  * each step, every candidate continuation scores `beam score + log p(token)`; the best
    2 x beam_width of them (over all beams and the whole vocabulary) are kept, best first;
  * a candidate that ends in EOS, or reaches max_tokens, and is among the first beam_width
    of them, becomes a finished hypothesis with score `sum of logprobs / generated_len **
    length_penalty` (generated_len counts the EOS); the best beam_width finished ones are kept;
  * the best beam_width candidates that did not end become the next beams;
  * the search stops at max_tokens, or as soon as beam_width hypotheses are finished and the
    best running beam, normalised by its current length, cannot beat the worst of them.
The best sequence therefore equals Hugging Face's greedy beam search output token for token
(tests/test_beam_search.py). vLLM's own `LLM.beam_search` differs: it normalises by the
length including the prompt, so its ranking can differ when length_penalty != 0.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nanopaged.config import check_range
from nanopaged.core.engine import EngineStalled, LLMEngine
from nanopaged.core.model_runner import ModelRunnerOutput
from nanopaged.core.request import Request, RequestStatus, SampledToken
from nanopaged.input_processor import PromptType
from nanopaged.sampling_params import SamplingParams


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        check_range("beam_width", self.beam_width, 1, integer=True)
        check_range("max_tokens", self.max_tokens, 1, integer=True)
        # Scores divide by generated_len ** length_penalty: past +-10 that power overflows a float.
        check_range("length_penalty", self.length_penalty, -10.0, 10.0)
        self.length_penalty = float(self.length_penalty)


@dataclass
class BeamSearchSequence:
    tokens: list[int]            # prompt + generated tokens (vLLM's convention)
    cum_logprob: float           # sum of the generated tokens' logprobs
    score: float                 # cum_logprob / generated_len ** length_penalty
    text: str = ""               # the generated text
    finish_reason: str = "length"   # "stop" (EOS) or "length"


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]   # best first


@dataclass
class _Beam:
    request: Request
    cum_logprob: float
    top: tuple[list[float], list[int]] | None = None   # its best next tokens, once computed


@dataclass
class _Search:
    """One prompt's search: its running beams and its finished hypotheses."""
    prompt: list[int]
    max_tokens: int              # the search's max_tokens, clipped to the context
    beams: list[_Beam]
    finished: list[BeamSearchSequence] = field(default_factory=list)
    generated: int = 0           # tokens generated so far by every running beam
    done: bool = False


def beam_search(engine: LLMEngine, prompts: PromptType | list[PromptType],
                params: BeamSearchParams) -> list[BeamSearchOutput]:
    """Beam search over each prompt (`LLM.beam_search`); the same checks as generate, first."""
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a prompt or a list of them, got {type(prompts).__name__}")
    if not isinstance(params, BeamSearchParams):
        raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
    if params.beam_width > engine.config.max_num_seqs:
        raise ValueError(f"beam_width={params.beam_width} is larger than max_num_seqs="
                         f"{engine.config.max_num_seqs}")
    vocab = engine.config.model_config.vocab_size
    if 2 * params.beam_width > vocab:      # each step keeps the best 2 x beam_width tokens
        raise ValueError(f"2 x beam_width={2 * params.beam_width} is larger than the vocabulary ({vocab})")
    if engine.scheduler.has_unfinished_requests():
        raise ValueError("beam_search needs an idle engine; finish the queued requests first")
    # Every prompt must fit, before any work; max_tokens past the context is clipped, as generate does.
    checked = [engine.process_request(f"beam-check-{i}", p, SamplingParams(max_tokens=params.max_tokens))
               for i, p in enumerate(prompts)]
    return BeamSearcher(engine, params).run([(seqs[0].prompt_token_ids, seqs[0].max_tokens) for seqs in checked])


class BeamSearcher:
    def __init__(self, engine: LLMEngine, params: BeamSearchParams) -> None:
        self.engine = engine
        self.params = params
        self.scheduler = engine.scheduler
        self.eos = frozenset(engine.config.model_config.eos_token_ids)
        self.num_requests = 0
        self.top: dict[Request, tuple[list[float], list[int]]] = {}   # filled by select_tokens

    def run(self, prompts: list[tuple[list[int], int]]) -> list[BeamSearchOutput]:
        """Search each (prompt, max_tokens); if anything fails, no beam is left in the engine."""
        searches = [_Search(p, n, [_Beam(self._new_request(p), 0.0)]) for p, n in prompts]
        try:
            return self._run(searches)
        except BaseException:
            for b in (b for s in searches for b in s.beams):
                if not b.request.is_finished:
                    self.scheduler.finish_request(b.request, RequestStatus.FINISHED_ABORTED)
            raise

    def _run(self, searches: list[_Search]) -> list[BeamSearchOutput]:
        for s in searches:
            self.scheduler.add_request(s.beams[0].request)
        while not all(s.done for s in searches):
            try:
                self.engine.step(self.select_tokens)
            except EngineStalled:
                self._unstall(searches)
                continue
            for s in searches:
                for b in s.beams:
                    b.top = self.top.pop(b.request, b.top)
                # A step of the search needs every beam's next-token logprobs; a beam that was
                # preempted and is being recomputed may lag behind its siblings.
                if not s.done and all(b.top is not None for b in s.beams):
                    self._step(s)
        return [self._output(s) for s in searches]

    def select_tokens(self, runner_output: ModelRunnerOutput) -> dict[Request, SampledToken]:
        """The rule handed to LLMEngine.step: note each beam's best 2 x beam_width next
        tokens and choose none; the search appends the tokens it picks (`_advance`)."""
        if runner_output.requests:
            logprobs = torch.log_softmax(runner_output.logits.float(), dim=-1)
            values, tokens = logprobs.topk(2 * self.params.beam_width, dim=-1)
            self.top.update(zip(runner_output.requests, zip(values.tolist(), tokens.tolist())))
        return {}

    def _unstall(self, searches: list[_Search]) -> None:
        """Beams that wait (holding blocks) for a sibling being recomputed may hold every block
        the sibling needs. Then the newest such beam gives its blocks back and queues again
        behind the sibling, as a fresh request with the same tokens: it is recomputed later."""
        beams = {b.request: b for s in searches for b in s.beams}
        idle = [r for r in self.scheduler.running if r.num_computed_tokens == r.num_tokens and r in beams]
        if not idle:
            raise RuntimeError("beam search stalled with nothing to free")   # cannot happen
        old = idle[-1]
        self.scheduler.finish_request(old, RequestStatus.FINISHED_ABORTED)
        new = self._new_request(old.prompt_token_ids)
        new.output_token_ids = list(old.output_token_ids)
        beams[old].request = new
        self.scheduler.add_request(new)

    def _new_request(self, tokens: list[int]) -> Request:
        """A beam is a request the engine never stops by itself (the search decides)."""
        self.num_requests += 1
        return Request(request_id=f"beam-{self.num_requests}", prompt_token_ids=list(tokens),
                       sampling_params=SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                       max_tokens=self.engine.config.max_model_len)

    # ---- one step of one prompt's search ---------------------------------------------
    def _step(self, s: _Search) -> None:
        p, width = self.params, self.params.beam_width
        cands = []       # (score, beam index, token, logprob)
        for i, b in enumerate(s.beams):
            values, tokens = b.top
            cands += [(b.cum_logprob + v, i, t, v) for v, t in zip(values, tokens)]
        cands.sort(key=lambda c: -c[0])
        cands = cands[:2 * width]
        length = s.generated + 1
        hits = [(not p.ignore_eos and t in self.eos) or length >= s.max_tokens for _, _, t, _ in cands]

        for j, ((score, i, t, _), hit) in enumerate(zip(cands, hits)):
            if j < width and hit:
                s.finished.append(self._hypothesis(s, s.beams[i], t, score, length))
        s.finished.sort(key=lambda h: -h.score)
        del s.finished[width:]

        chosen = [c for c, hit in zip(cands, hits) if not hit][:width]
        s.beams = self._advance(s.beams, chosen)
        s.generated = length
        if length >= s.max_tokens or self._cannot_improve(s):
            for b in s.beams:
                self.scheduler.finish_request(b.request, RequestStatus.FINISHED_LENGTH)
            s.beams, s.done = [], True

    def _advance(self, beams: list[_Beam], chosen) -> list[_Beam]:
        """Fork the beams that continue, append their tokens, finish the ones that end here."""
        new, used = [], set()
        for score, i, t, _ in chosen:
            parent = beams[i].request
            if i in used:                     # a second continuation of the same beam: fork it
                child = self._new_request(parent.prompt_token_ids)
                child.output_token_ids = list(parent.output_token_ids)
                self.scheduler.fork(parent, child)
                req = child
            else:
                req = parent
            used.add(i)
            new.append((_Beam(req, score), t))
        # Fork first, append after: every child must copy the parent's tokens before any is appended.
        for beam, t in new:
            beam.request.output_token_ids.append(t)
        for i, b in enumerate(beams):
            if i not in used:
                self.scheduler.finish_request(b.request, RequestStatus.FINISHED_LENGTH)
        return [beam for beam, _ in new]

    def _hypothesis(self, s: _Search, beam: _Beam, token: int, score: float, length: int) -> BeamSearchSequence:
        generated = beam.request.output_token_ids + [token]
        ends_in_eos = not self.params.ignore_eos and token in self.eos
        return BeamSearchSequence(
            tokens=s.prompt + generated, cum_logprob=score,
            score=score / (length ** self.params.length_penalty),
            text=self.engine.tokenizer.decode(generated, skip_special_tokens=True),
            finish_reason="stop" if ends_in_eos else "length")

    def _cannot_improve(self, s: _Search) -> bool:
        """HF's early-stop heuristic (early_stopping=False): best running / current length."""
        if len(s.finished) < self.params.beam_width:
            return False
        best_running = s.beams[0].cum_logprob / (s.generated ** self.params.length_penalty)
        return not best_running > s.finished[-1].score

    def _output(self, s: _Search) -> BeamSearchOutput:
        return BeamSearchOutput(sequences=list(s.finished))
