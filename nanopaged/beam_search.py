"""Beam search on shared blocks (paper section 4.4, "beam search").

Every beam is an engine Request. A beam that survives a step with several continuations
forks (Scheduler.fork): the children share all of its blocks, and copy-on-write gives each
a private copy of the partly filled last block when it writes into it. A beam with no
surviving continuation is finished, and its blocks go back unless another beam still
holds them. So beams that share a long history share its K/V, which is where the paper's
37.6-55.2% memory saving for beam search comes from.

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

from nanopaged.request import Request, RequestStatus
from nanopaged.sampling_params import SamplingParams


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer in [1, inf], got {v!r}")
        if not isinstance(self.length_penalty, (int, float)) or self.length_penalty != self.length_penalty:
            raise ValueError(f"length_penalty must be a number, got {self.length_penalty!r}")


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
    beams: list[_Beam]
    finished: list[BeamSearchSequence] = field(default_factory=list)
    generated: int = 0           # tokens generated so far by every running beam
    done: bool = False


class BeamSearcher:
    def __init__(self, engine, params: BeamSearchParams) -> None:
        self.engine = engine
        self.params = params
        self.scheduler = engine.scheduler
        self.eos = frozenset(engine.model_config.eos_token_ids)
        self.num_requests = 0

    def run(self, prompts: list[list[int]]) -> list[BeamSearchOutput]:
        searches = [_Search(p, [_Beam(self._new_request(p), 0.0)]) for p in prompts]
        for s in searches:
            self.scheduler.add_request(s.beams[0].request)
        while not all(s.done for s in searches):
            out = self.scheduler.schedule()
            if not out.scheduled:
                # Stalled: beams that wait for a recomputed sibling hold the blocks it needs.
                if not self.scheduler.preempt_idle():
                    raise RuntimeError("beam search stalled with nothing to free")   # cannot happen
                continue
            self.engine.record_memory(out)
            k = 2 * self.params.beam_width
            top = self.engine.runner.execute_top_logprobs(out, k) if out.scheduled else {}
            self.scheduler.update(out, {})          # advance the counters; the tokens are ours to pick
            for s in searches:
                for b in s.beams:
                    b.top = top.get(b.request.request_id, b.top)
                # A step of the search needs every beam's next-token logprobs; a beam that was
                # preempted and is being recomputed may lag behind its siblings.
                if not s.done and all(b.top is not None for b in s.beams):
                    self._step(s)
        return [self._output(s) for s in searches]

    def _new_request(self, tokens: list[int]) -> Request:
        """A beam is a request the scheduler never stops by itself (the search decides)."""
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
        hits = [(not p.ignore_eos and t in self.eos) or length >= p.max_tokens for _, _, t, _ in cands]

        for j, ((score, i, t, _), hit) in enumerate(zip(cands, hits)):
            if j < width and hit:
                s.finished.append(self._hypothesis(s, s.beams[i], t, score, length))
        s.finished.sort(key=lambda h: -h.score)
        del s.finished[width:]

        chosen = [c for c, hit in zip(cands, hits) if not hit][:width]
        s.beams = self._advance(s.beams, chosen)
        s.generated = length
        if length >= p.max_tokens or self._cannot_improve(s):
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
