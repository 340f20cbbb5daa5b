"""The `LLM` you import: the core's generate and chat (core/llm.py), plus the extensions.

    LLM()                    the demo model when no model is given (extras/demo_model.py)
    LLM.beam_search          beam search on shared blocks (extras/beam_search.py)
    LLM.get_stats            statistics of every step (extras/stats.py), reset by reset_stats
    the progress bar         shows output tokens/s, KV usage, prefix-cache hit rate, preemptions
    cpu_threads="auto"       torch's CPU threads follow the free cores (extras/thread_governor.py)
    tensor_parallel_size=N   N ranks, 1/N of the heads each, behind the runner (extras/tensor_parallel/)

Each reaches the engine only through its hooks (a step observer, a token-selection rule,
`make_runner`).
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager

from nanopaged.config import EngineConfig
from nanopaged.core import llm as core
from nanopaged.extras.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from nanopaged.extras.demo_model import DEMO_MODEL, demo_model_path
from nanopaged.extras.stats import EngineStats, ProgressBar
from nanopaged.extras.thread_governor import ThreadGovernor
from nanopaged.input_processor import PromptType


class LLM(core.LLM):
    def __init__(self, model: str | None = None, **config) -> None:
        if model is None or model == DEMO_MODEL:
            model = str(demo_model_path())
        governor = ThreadGovernor()          # made first: the model's loading is its first window
        super().__init__(model, **config)
        self.stats = EngineStats(self.llm_engine)
        self.thread_governor = None
        cfg = self.llm_engine.config
        if cfg.cpu_threads == "auto" and cfg.device == "cpu" and cfg.tensor_parallel_size == 1:
            self.thread_governor = governor
            self.llm_engine.observers.append(governor)

    def make_runner(self, config: EngineConfig):
        """tensor_parallel_size > 1: the driver's runner with N ranks behind it (each rank has
        cores // N threads, so no governor); the workers stop when this LLM is deleted."""
        if config.tensor_parallel_size == 1:
            return super().make_runner(config)
        from nanopaged.extras.tensor_parallel import TensorParallelRunner   # torch.distributed only when used
        runner = TensorParallelRunner(config)
        weakref.finalize(self, runner.shutdown)
        return runner

    @contextmanager
    def one_call_at_a_time(self):
        """The core's guard; with cpu_threads="auto", the thread count is fitted before the call
        and given back after it (torch's count is process-wide)."""
        with super().one_call_at_a_time():
            try:
                if self.thread_governor is not None:
                    self.thread_governor.start()
                yield
            finally:
                if self.thread_governor is not None:
                    self.thread_governor.restore()

    def beam_search(self, prompts: PromptType | list[PromptType],
                    params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Beam search with Hugging Face's rule; beams share blocks (extras/beam_search.py)."""
        with self.one_call_at_a_time():
            return beam_search(self.llm_engine, prompts, params)

    def get_stats(self) -> dict:
        return self.stats.as_dict()

    def reset_stats(self) -> None:
        self.stats.reset()

    def progress_bar(self, total: int, enabled: bool) -> ProgressBar:
        return ProgressBar(self.stats, total, enabled)
