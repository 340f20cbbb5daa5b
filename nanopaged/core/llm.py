"""LLM: vLLM's offline API. `LLM(model).generate(prompts, params)` -> list[RequestOutput].

A thin loop over LLMEngine: validate every prompt (all of them before any work, so one
bad prompt fails the call before anything runs), queue them, then step until all are done.
The `LLM` you import (`nanopaged/llm.py`) is this class plus the extensions' entry points:
beam search, statistics, live figures on the progress bar, and the demo model as default.
docs/00_how_to_read.md walks one call from here down to the attention kernels.
"""
from __future__ import annotations

import itertools
import threading
from contextlib import contextmanager
from typing import Sequence

from tqdm.auto import tqdm

from nanopaged.config import EngineConfig
from nanopaged.core.engine import LLMEngine
from nanopaged.core.model_runner import ModelRunner
from nanopaged.input_processor import PromptType, render_chat
from nanopaged.outputs import RequestOutput
from nanopaged.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, **config) -> None:
        self.llm_engine = LLMEngine(EngineConfig.from_kwargs(str(model), **config), self.make_runner)
        self._request_ids = itertools.count()
        self._busy = threading.Lock()

    def make_runner(self, config: EngineConfig) -> ModelRunner:
        """The engine's runner; nanopaged/llm.py's LLM may choose another with its interface."""
        return ModelRunner(config)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for one prompt or many; outputs come back in the order of the prompts."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a prompt or a list of them, got {type(prompts).__name__}")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, (list, tuple)):
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts; "
                                 "give one, or one per prompt")
        else:
            raise ValueError(f"sampling_params must be a SamplingParams or a list of them, "
                             f"got {type(sampling_params).__name__}")
        with self.one_call_at_a_time():
            engine = self.llm_engine
            requests = [engine.process_request(self._new_request_id(), p, sp)
                        for p, sp in zip(prompts, params)]   # every prompt is checked before any is queued
            for samples in requests:
                engine.queue(samples)
            return self._run([samples[0].request_id for samples in requests], use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of them."""
        one = isinstance(messages, (list, tuple)) and bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if one else messages
        if not isinstance(conversations, (list, tuple)):
            raise ValueError(f"messages must be a conversation or a list of them, got {type(messages).__name__}")
        tokenizer = self.llm_engine.tokenizer
        prompts = [render_chat(tokenizer, conv, chat_template) for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Step until every request is done; their final outputs, in the order of request_ids.
        If anything fails meanwhile (a step, Ctrl-C), these requests are aborted, so the
        engine holds nothing of this call when the error reaches the caller."""
        engine, wanted, finished = self.llm_engine, set(request_ids), {}
        try:
            with self.progress_bar(len(request_ids), use_tqdm) as bar:
                while engine.has_unfinished_requests():
                    for output in engine.step():
                        if output.finished and output.request_id in wanted:
                            finished[output.request_id] = output
                            bar.update(1)
        except BaseException:
            for request_id in request_ids:
                engine.abort_request(request_id)
            raise
        return [finished[i] for i in request_ids]

    def _new_request_id(self) -> str:
        """An id no queued request has (a user may queue their own through llm_engine)."""
        request_id = str(next(self._request_ids))
        while request_id in self.llm_engine.output_processor.requests:
            request_id = str(next(self._request_ids))
        return request_id

    @contextmanager
    def one_call_at_a_time(self):
        """An LLM is not thread-safe (nor is vLLM's): a second concurrent call is an error,
        not a silent corruption of the engine's state."""
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("this LLM is already running a call in another thread; an LLM is not "
                               "thread-safe: use one LLM per thread, or a lock around each call")
        try:
            yield
        finally:
            self._busy.release()

    def progress_bar(self, total: int, enabled: bool):
        """A bar over the prompts; nanopaged/llm.py's LLM adds the figures a user watches."""
        return tqdm(total=total, desc="Processed prompts", disable=not enabled, dynamic_ncols=True)
