"""Beam search on shared blocks (paper section 4.4, "beam search").

Every beam is an engine sequence. The search drives the engine through its public hooks
only: the first beam of each prompt is queued (`LLMEngine.queue`), and each step runs with the
search's own token-selection rule (`LLMEngine.step(select_tokens)`). The rule reads each
beam's best next tokens off its logits row and, once every beam of a prompt has its row,
takes one step of the search and returns the chosen tokens: a beam's first continuation is
its own next token; each further one is a new sequence (`LLMEngine.track`) forked off it
(`SampledToken.parent`), so the children share all of its blocks, and copy-on-write gives
each a private copy of the partly filled last block when it writes into it. A beam that no
candidate continues is aborted (`LLMEngine.abort_request`) and its blocks go back unless
another beam still holds them. So beams that share a long history share its K/V, which is
where the paper's 37.6-55.2% memory saving for beam search comes from. If one beam of a
prompt was preempted, its siblings do not wait holding their blocks: they give them back,
keep their next tokens, and are queued again from their tokens once the search moves on.
docs/06_sharing.md explains it.

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
(tests/extras/test_beam_search.py). vLLM's own `LLM.beam_search` differs: it normalises by the
length including the prompt, so its ranking can differ when length_penalty != 0.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nanopaged.core.request import Request, SampledToken
from nanopaged.engine.input_processor import PromptType
from nanopaged.engine.llm_engine import LLMEngine
from nanopaged.sampling_params import SamplingParams
from nanopaged.validation import check_range, per_prompt
from nanopaged.worker.model_runner import ModelRunnerOutput


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
    tokens: list[int]                     # prompt + generated tokens
    cum_logprob: float
    request: Request | None = None        # the engine sequence computing it; None: queue it from its tokens
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
    lora_request: object = None  # the prompt's LoRA adapter (nanopaged/lora/), its beams' too


def beam_search(engine: LLMEngine, prompts: PromptType | list[PromptType],
                params: BeamSearchParams, lora_request=None) -> list[BeamSearchOutput]:
    """Beam search over each prompt (`LLM.beam_search`); the same checks as generate, first.
    `lora_request`: one LoRARequest for all prompts or one per prompt, as in generate."""
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
    if engine.config.speculative_config is not None:   # beams choose their own tokens: nothing to verify
        raise ValueError("beam_search does not run on an engine with speculative_config; build an LLM without it")
    # Every prompt must fit, before any work; max_tokens past the context is clipped, as generate does.
    loras = per_prompt("lora_request", lora_request, len(prompts))
    checked = [engine.process_request(f"beam-check-{i}", p, SamplingParams(max_tokens=params.max_tokens),
                                     lora_request=lora)
               for i, (p, lora) in enumerate(zip(prompts, loras))]
    return BeamSearcher(engine, params).run([(seqs[0].prompt_token_ids, seqs[0].max_tokens,
                                              seqs[0].extension_fields.get("lora_request"))
                                             for seqs in checked])


class BeamSearcher:
    def __init__(self, engine: LLMEngine, params: BeamSearchParams) -> None:
        self.engine = engine
        self.params = params
        self.eos = frozenset(engine.config.model_config.eos_token_ids)
        self.num_requests = 0
        self.searches: list[_Search] = []
        self.beam_of: dict[Request, tuple[_Search, _Beam]] = {}   # the engine sequences of live beams
        self.let_go: list[Request] = []      # sequences the last step's rule let go: aborted after it

    def run(self, prompts: list[tuple[list[int], int, object]]) -> list[BeamSearchOutput]:
        """Search each (prompt, max_tokens); if anything fails, no beam is left in the engine."""
        self.searches = [_Search(p, n, [_Beam(list(p), 0.0)], lora_request=lora) for p, n, lora in prompts]
        try:
            while not all(s.done for s in self.searches):
                self._queue_beams_without_a_sequence()
                self.engine.step(self.select_tokens)
                self._abort_let_go()
            while self.engine.has_unfinished_requests():   # hand out the aborted beams' final outputs
                self.engine.step()
        except BaseException:
            self.let_go += list(self.beam_of)
            self._abort_let_go()
            raise
        return [BeamSearchOutput(sequences=list(s.finished)) for s in self.searches]

    def select_tokens(self, runner_output: ModelRunnerOutput) -> dict[Request, list[SampledToken]]:
        """The rule handed to LLMEngine.step: note each beam's best 2 x beam_width next tokens,
        step every search whose beams all have theirs, and return the tokens it chose."""
        if runner_output.requests:
            logprobs = torch.log_softmax(runner_output.logits.float(), dim=-1)
            values, tokens = logprobs.topk(2 * self.params.beam_width, dim=-1)
            for request, v, t in zip(runner_output.requests, values.tolist(), tokens.tolist()):
                self.beam_of[request][1].top = (v, t)
        sampled: dict[Request, list[SampledToken]] = {}
        for s in self.searches:
            if not s.done and all(b.top is not None for b in s.beams):
                self._step(s, sampled)
        # A beam whose search could not step (a sibling is preempted or still computing) would
        # hold its blocks idle: it gives them back, keeps its next tokens, and is queued again later.
        for request in runner_output.requests:
            if request not in sampled and request in self.beam_of:
                self._let_go(request)
        return sampled

    def _let_go(self, request: Request) -> None:
        self.beam_of.pop(request)[1].request = None
        self.let_go.append(request)

    def _abort_let_go(self) -> None:
        for request in self.let_go:
            self.engine.abort_request(request.request_id)
        self.let_go = []

    def _queue_beams_without_a_sequence(self) -> None:
        """The first beam of each prompt, and beams that gave their blocks back, become sequences."""
        for s in self.searches:
            for b in s.beams:
                if not s.done and b.request is None and b.top is None:
                    b.request = self._new_sequence(s, b.tokens)
                    self.beam_of[b.request] = (s, b)
                    self.engine.queue([b.request])

    def _new_sequence(self, s: _Search, tokens: list[int]) -> Request:
        """An engine sequence for a beam's tokens, which stops by itself only at the search's
        max_tokens; the search ends it earlier (abort) when no candidate continues it."""
        self.num_requests += 1
        params = SamplingParams(temperature=0, ignore_eos=True,
                                max_tokens=s.max_tokens - (len(tokens) - len(s.prompt)))
        [request] = self.engine.process_request(f"beam-{self.num_requests}", {"prompt_token_ids": tokens}, params,
                                                lora_request=s.lora_request)
        return request

    # ---- one step of one prompt's search ---------------------------------------------
    def _step(self, s: _Search, sampled: dict[Request, list[SampledToken]]) -> None:
        p, width = self.params, self.params.beam_width
        cands = []       # (score, beam index, token)
        for i, b in enumerate(s.beams):
            values, tokens = b.top
            cands += [(b.cum_logprob + v, i, t) for v, t in zip(values, tokens)]
        cands.sort(key=lambda c: -c[0])
        cands = cands[:2 * width]
        length = s.generated + 1
        hits = [(not p.ignore_eos and t in self.eos) or length >= s.max_tokens for _, _, t in cands]

        for j, ((score, i, t), hit) in enumerate(zip(cands, hits)):
            if j < width and hit:
                s.finished.append(self._hypothesis(s, s.beams[i], t, score, length))
        s.finished.sort(key=lambda h: -h.score)
        del s.finished[width:]

        chosen = [c for c, hit in zip(cands, hits) if not hit][:width]
        old, s.generated = s.beams, length
        s.done = not chosen or length >= s.max_tokens or self._cannot_improve(s, chosen[0][0])
        s.beams = [] if s.done else self._continue(s, old, chosen, sampled)
        for b in old:                       # the beams no candidate continues end here
            if b.request is not None and b.request not in sampled:
                self._let_go(b.request)

    def _continue(self, s: _Search, old: list[_Beam], chosen, sampled) -> list[_Beam]:
        """The next beams, and their tokens: the first continuation of a beam is its own next
        token; each further one is a new sequence forked off it, sharing its blocks."""
        new, used = [], set()
        for score, i, t in chosen:
            parent = old[i]
            beam = _Beam(parent.tokens + [t], score)
            if parent.request is None:
                pass                        # the parent gave its blocks back: queued from its tokens
            elif i not in used:
                beam.request = parent.request
                sampled[beam.request] = [SampledToken(t)]
            else:
                beam.request = self._new_sequence(s, parent.tokens)
                self.engine.track([beam.request])
                sampled[beam.request] = [SampledToken(t, parent=parent.request)]
            if beam.request is not None:
                self.beam_of[beam.request] = (s, beam)
            used.add(i)
            new.append(beam)
        return new

    def _hypothesis(self, s: _Search, beam: _Beam, token: int, score: float, length: int) -> BeamSearchSequence:
        generated = beam.tokens[len(s.prompt):] + [token]
        ends_in_eos = not self.params.ignore_eos and token in self.eos
        return BeamSearchSequence(
            tokens=beam.tokens + [token], cum_logprob=score,
            score=score / (length ** self.params.length_penalty),
            text=self.engine.tokenizer.decode(generated, skip_special_tokens=True),
            finish_reason="stop" if ends_in_eos else "length")

    def _cannot_improve(self, s: _Search, best_running_score: float) -> bool:
        """HF's early-stop heuristic (early_stopping=False): best running / current length."""
        if len(s.finished) < self.params.beam_width:
            return False
        return not best_running_score / (s.generated ** self.params.length_penalty) > s.finished[-1].score
