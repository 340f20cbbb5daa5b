"""LLM: vLLM's offline API. `LLM(model).generate(prompts, params)` -> list[RequestOutput].

A thin loop over LLMEngine: validate and queue every prompt (all of them before any
work, so one bad prompt fails the call before anything runs), then step until all are
done, with a progress bar that shows the figures a user watches.
"""
from __future__ import annotations

import itertools
import time
from typing import Sequence

from tqdm.auto import tqdm

from nanopaged.beam_search import BeamSearcher, BeamSearchOutput, BeamSearchParams
from nanopaged.config import EngineConfig
from nanopaged.demo_model import DEMO_MODEL, demo_model_path
from nanopaged.engine import LLMEngine, PromptType
from nanopaged.outputs import RequestOutput
from nanopaged.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **config) -> None:
        if model is None or model == DEMO_MODEL:
            model = str(demo_model_path())
        self.llm_engine = LLMEngine(EngineConfig.from_kwargs(str(model), **config))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for one prompt or many; outputs come back in the order of the prompts."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts; "
                                 "give one, or one per prompt")
        engine = self.llm_engine
        # Validate everything first: a bad prompt raises before any request is queued.
        requests = [engine.make_request(str(next(self._ids)), p, sp) for p, sp in zip(prompts, params)]
        for r in requests:
            engine.submit(r)
        return self._run(requests, use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.llm_engine.tokenizer
        prompts = []
        for conv in conversations:
            text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True,
                                           chat_template=chat_template)
            # The template already wrote the special tokens; do not add a BOS again.
            prompts.append({"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(self, prompts: PromptType | Sequence[PromptType],
                    params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Beam search with Hugging Face's rule; beams share blocks (beam_search.py)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        engine = self.llm_engine
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        if params.beam_width > engine.config.max_num_seqs:
            raise ValueError(f"beam_width={params.beam_width} is larger than max_num_seqs="
                             f"{engine.config.max_num_seqs}")
        if engine.has_unfinished_requests():
            raise ValueError("beam_search needs an idle engine; finish the queued requests first")
        # The same checks as generate: every prompt must fit, before any work is done.
        token_ids = []
        for p in prompts:
            r = engine.make_request(f"beam-check-{next(self._ids)}", p,
                                    SamplingParams(max_tokens=params.max_tokens))
            token_ids.append(r.prompt_token_ids)
        return BeamSearcher(engine, params).run(token_ids)

    def get_stats(self) -> dict:
        return self.llm_engine.get_stats()

    def _run(self, requests, use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(requests), desc="Processed prompts", disable=not use_tqdm,
                   dynamic_ncols=True)
        start, out_tokens = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            outputs = engine.step()
            out_tokens += len(outputs)
            for o in outputs:
                if o.finished:
                    finished[o.request_id] = o
                    bar.update(1)
            if use_tqdm:
                stats = engine.get_stats()
                bar.set_postfix_str(
                    f"out {out_tokens / (time.perf_counter() - start):.1f} tok/s, "
                    f"KV {stats['kv_cache_usage']:.1%}, "
                    f"prefix hit {_hit_rate(stats):.0%}, "
                    f"preempted {stats['num_preemptions']}", refresh=False)
        bar.close()
        return [finished[r.request_id] for r in requests]


def _hit_rate(stats: dict) -> float:
    q = stats["prefix_cache_queries"]
    return stats["prefix_cache_hits"] / q if q else 0.0
