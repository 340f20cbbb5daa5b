"""LLM: vLLM's offline API. `LLM(model).generate(prompts, params)` -> list[RequestOutput].

A thin loop over LLMEngine: validate every prompt (all of them before any work, so one
bad prompt fails the call before anything runs), queue them, then step until all are done.
The `LLM` you import (`nanopaged/llm.py`) is this class plus the extensions' entry points:
beam search, statistics, live figures on the progress bar, and the demo model as default.
docs/00_how_to_read.md walks one call from here down to the attention kernels.
"""
from __future__ import annotations

import itertools
from typing import Sequence

from tqdm.auto import tqdm

from nanopaged.config import EngineConfig
from nanopaged.core.engine import LLMEngine
from nanopaged.input_processor import PromptType
from nanopaged.outputs import RequestOutput
from nanopaged.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, **config) -> None:
        self.llm_engine = LLMEngine(EngineConfig.from_kwargs(str(model), **config))
        self._request_ids = itertools.count()

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
        requests = [engine.process_request(str(next(self._request_ids)), p, sp)
                    for p, sp in zip(prompts, params)]   # every prompt is checked before any is queued
        for samples in requests:
            engine.queue(samples)
        return self._run([samples[0].request_id for samples in requests], use_tqdm)

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

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Step until every request is done; their final outputs, in the order of request_ids."""
        engine, finished = self.llm_engine, {}
        with self.progress_bar(len(request_ids), use_tqdm) as bar:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[i] for i in request_ids]

    def progress_bar(self, total: int, enabled: bool):
        """A bar over the prompts; nanopaged/llm.py's LLM adds the figures a user watches."""
        return tqdm(total=total, desc="Processed prompts", disable=not enabled, dynamic_ncols=True)
