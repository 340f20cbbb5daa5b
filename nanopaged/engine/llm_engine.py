"""LLMEngine: requests in, one step at a time, RequestOutputs out.

    add_request   tokenize and validate (input_processor.py), then queue the request
    step          schedule -> execute -> update -> outputs

All validation happens before a request is queued: one that can never run raises
ValueError and the engine goes on serving the others. `LLM.generate` (llm.py) is a loop
over `step`; drive the engine directly to stream. docs/00_how_to_read.md walks one step.

Everything beyond the core attaches through one interface, `Extension` (extension.py): the engine
installs each registered kind (nanopaged/extensions.py) that its settings ask for, or that a request's
fields ask for the first time one does, and calls the hooks each extension overrides, in the
registry's order. `install` adds an extension object made elsewhere (the statistics, the thread
governor, a benchmark's watcher); `find` looks installed ones up by type. `step(select_tokens)` takes
a token-selection rule for one step (a search that chooses its own tokens); `make_runner` builds
another runner with ModelRunner's interface (ranks behind it). docs/00_how_to_extend.md.
"""
from __future__ import annotations

import threading
import time
from dataclasses import fields as dataclass_fields
from functools import cached_property
from typing import Callable, Sequence, TypeVar

from nanopaged.config import EngineConfig
from nanopaged.core.block_pool import BlockPool
from nanopaged.core.encoder_cache import EncoderCache
from nanopaged.core.request import Request, RequestStatus, SampledToken
from nanopaged.core.scheduler import Scheduler, SchedulerOutput
from nanopaged.engine.batch_queue import BatchQueue
from nanopaged.engine.extension import Extension, StepRecord, TokenSelection
from nanopaged.engine.input_processor import InputProcessor, PromptType, load_tokenizer
from nanopaged.engine.output_processor import OutputProcessor
from nanopaged.engine.overlap import OverlappedSteps, resolve_async_scheduling
from nanopaged.extensions import EXTENSIONS
from nanopaged.models.pipeline import ModelStage
from nanopaged.outputs import RequestOutput
from nanopaged.sample.parallel_sampling import ParallelSampler
from nanopaged.sample.sampler import Sampler
from nanopaged.sampling_params import SamplingParams
from nanopaged.vllm_compat import VllmModelConfig
from nanopaged.worker.model_runner import ModelRunner, ModelRunnerOutput

# A token-selection rule: each sampling request's tokens this step (one; with drafts, those accepted and one more)
SelectTokens = Callable[[ModelRunnerOutput], dict[Request, list[SampledToken]]]
E = TypeVar("E")


class LLMEngine:
    def __init__(self, config: EngineConfig,
                 make_runner: Callable[[EngineConfig, list[ModelStage]], ModelRunner] = ModelRunner,
                 extensions: Sequence[type[Extension]] = EXTENSIONS) -> None:
        self.config = config
        self.extension_kinds = tuple(extensions)      # what may be installed, in the order hooks run
        self.request_fields = {name for kind in self.extension_kinds for name in kind.request_fields}
        for kind in self.extension_kinds:             # every setting checked before any weight loads
            kind.check_config(config)
        wanted = [kind(config) for kind in self.extension_kinds if kind.wanted(config)]
        self.tokenizer = load_tokenizer(config.tokenizer)
        self.runner = make_runner(config, [stage for ext in wanted for stage in ext.model_stages()])
        hybrid = config.model_config.hybrid       # a state-space model's state: pages beside the blocks
        state_pages = hybrid.num_state_groups if hybrid else 0
        block_pool = BlockPool(self.runner.num_kv_blocks, config.block_size,
                               config.enable_prefix_caching, config.prefix_hash, state_pages)
        encoder_cache = EncoderCache(config.encoder_cache_size or 0, config.max_num_encoder_input_tokens or 0)
        self.scheduler = Scheduler(block_pool, config.max_num_seqs, config.max_num_batched_tokens, encoder_cache)
        self.input_processor = InputProcessor(config, self.tokenizer, self.runner.num_kv_blocks - state_pages)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.sampler = Sampler(self.runner.device, config.seed, self.runner.fast_path.argmax)
        self.token_selection: TokenSelection = ParallelSampler(self.sampler)
        self.extensions: list[Extension] = []          # installed, in the order their hooks run
        self.hooks: dict[str, list[Callable]] = {name: [] for name in HOOKS}
        self._installing = threading.RLock()     # the server adds requests on several threads
        for ext in wanted:
            self.install(ext)
        # async scheduling: the same step, pipelined on two threads (overlap.py); None: one step at a time
        self.overlap = OverlappedSteps(self) if resolve_async_scheduling(config) else None
        # a runner that computes several batches at once (a pipeline of ranks): batches in flight (batch_queue.py)
        self.batch_queue = BatchQueue(self) if getattr(self.runner, "max_concurrent_batches", 1) > 1 else None

    def get_tokenizer(self):
        return self.tokenizer

    @cached_property
    def model_config(self):
        """vLLM's ModelConfig, with the names its clients read (nanopaged/vllm_compat.py)."""
        return VllmModelConfig(self.config)

    # ---- extensions -----------------------------------------------------------------------
    def install(self, ext: Extension) -> Extension:
        """Attach an extension: it looks at the engine, then each hook it overrides joins the
        engine's lists, in the registry's order of kinds (others after them, in the order given)."""
        with self._installing:
            ext.attach(self)
            order = self._order(type(ext))
            at = sum(1 for e in self.extensions if self._order(type(e)) <= order)
            self.extensions.insert(at, ext)
            self.token_selection = ext.wrap_token_selection(self.token_selection)
            self.input_processor = ext.input_processor(self.input_processor)
            self.output_processor = ext.output_processor(self.output_processor)
            self._rebuild_hooks()
            return ext

    def remove(self, ext: Extension) -> None:
        """Detach an extension that changes nothing but watches (a progress bar, a benchmark's timer)."""
        with self._installing:
            self.extensions.remove(ext)
            self._rebuild_hooks()

    def _order(self, kind: type) -> int:
        kinds = self.extension_kinds
        return kinds.index(kind) if kind in kinds else len(kinds)

    def _rebuild_hooks(self) -> None:
        """The lists the step walks: each extension's bound methods for the hooks it overrides. The
        scheduler, runner, sampler and output processor are handed theirs."""
        self.hooks = {name: [getattr(e, name) for e in self.extensions if type(e).overrides(name)] for name in HOOKS}
        self.scheduler.admission_rules = self.hooks["admit"]
        self.scheduler.block_sources = self.hooks["supply_blocks"]
        self.runner.before_forward = self.hooks["before_forward"]
        self.sampler.logits_processors = self.hooks["process_logits"]
        self.output_processor.stop_rules = self.hooks["stop"]

    def find(self, kind: type[E]) -> E | None:
        """The installed extension of this type (or offering this capability), or None."""
        return next((e for e in self.extensions if isinstance(e, kind)), None)

    def extension(self, kind: type[E], fields: dict | None = None) -> E | None:
        """The installed extension of this kind; if there is none, installed now where a request (with
        these fields) may install it (`Extension.late_install`), else None."""
        with self._installing:            # another thread may be installing it now
            found = self.find(kind)
            if found is None and kind.late_install(self.config, fields or {}):
                found = self.install(kind(self.config))
            return found

    # ---- requests in ----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    **fields) -> None:
        self.queue(self.process_request(request_id, prompt, params, **fields))

    def process_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                        **fields) -> list[Request]:
        """Tokenize and validate without queueing: the request's n sequences, or a ValueError.
        `fields`: keywords an extension implements (vLLM's `lora_request`); a None value is absent."""
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {request_id!r}")
        fields = {name: value for name, value in fields.items() if value is not None}
        known = self.request_fields
        keywords = known - PARAM_FIELDS
        if not set(fields) <= keywords:
            raise ValueError(f"unknown request field(s) {sorted(set(fields) - keywords)}; known: {sorted(keywords)}")
        samples = self.input_processor.process(request_id, prompt, params)
        params = samples[0].sampling_params
        given = {**{name: getattr(params, name) for name in known & PARAM_FIELDS
                    if getattr(params, name, None) is not None}, **fields}
        for kind in self.extension_kinds:       # installed on first use, in the registry's order
            if set(kind.request_fields) & set(given):
                self.extension(kind, given)
        for ext in self.extensions:              # their own checks and work, before any queueing
            if set(type(ext).request_fields) & set(given):
                ext.prepare(samples, given)
        keys = tuple(key for key_of in self.hooks["block_hash_keys"] for key in key_of(samples[0]))
        for sample in samples:
            sample.extra_keys = keys
        return samples

    def queue(self, samples: list[Request]) -> None:
        """Queue the first sequence; the others (n > 1) fork off it once its prompt is done."""
        self.track(samples)
        self.scheduler.add_request(samples[0])

    def track(self, samples: list[Request]) -> None:
        """Follow these sequences' tokens, stops and outputs without queueing any of them: a
        token-selection rule forks them off a running sequence (`SampledToken.parent`)."""
        if samples[0].request_id in self.output_processor.requests:
            raise ValueError(f"request_id {samples[0].request_id!r} is already in use")
        self.output_processor.add(samples)
        self.token_selection.add(samples)

    def abort_request(self, request_id: str) -> None:
        """Its blocks go back now; the next step returns its final output ("abort")."""
        for request in self.output_processor.abort(request_id):
            self._finish(request, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.output_processor.aborted)

# ---- one step -------------------------------------------------------------------------
    def step(self, select_tokens: SelectTokens | None = None) -> list[RequestOutput]:
        """Schedule, run the model once, choose tokens, update; the outputs of the requests
        that advanced. `select_tokens` replaces the sampler (a search that chooses its own); it
        must give every row a token, unless its caller aborts that request before the next step.
        If the step fails, its requests end with "abort" and the error goes on to the caller.
        With async_scheduling the same work runs pipelined (overlap.py), but for the steps whose next one
        depends on their tokens: a rule chooses the tokens, or an extension proposes drafts from them."""
        if self.batch_queue is not None:
            return self.batch_queue.step(select_tokens)
        if self.overlap is not None:
            ahead = select_tokens is None and not self.hooks["propose"]   # the next step needs no token of this one
            if select_tokens is not None and self.overlap.in_flight is not None:
                raise RuntimeError("a token-selection rule cannot take over a step already computing")
            if ahead or self.overlap.in_flight is not None:
                return self.overlap.step(ahead)
        aborted, self.output_processor.aborted = self.output_processor.aborted, []
        t0 = time.perf_counter()
        scheduler_output = self.scheduler.schedule()                                 # 1. schedule
        if not scheduler_output.scheduled:
            self.check_not_stalled(aborted)
            return aborted
        try:
            t1 = time.perf_counter()
            inputs = self.runner.prepare_inputs(scheduler_output)                    # 2. execute
            t2 = time.perf_counter()
            runner_output = self.runner.forward(scheduler_output, inputs)
            t3 = time.perf_counter()
            sampled = (select_tokens or self.token_selection)(runner_output)
            t4 = time.perf_counter()
            self.scheduler.update(scheduler_output, sampled)                         # 3. update
            t5 = time.perf_counter()
            outputs, stopped = self.output_processor.process(sampled, runner_output.prompt_logits)  # 4. outputs
            phases = {"schedule": t1 - t0, "prepare": t2 - t1, "forward": t3 - t2, "sample": t4 - t3,
                      "update": t5 - t4, "output": time.perf_counter() - t5}
            self.finish_step(StepRecord(scheduler_output, sampled, outputs, stopped, self.scheduler.running,
                                        (t0, t2, t4, t5), phases))
        except BaseException:
            self.abort_step(scheduler_output)
            raise
        return aborted + outputs

    def finish_step(self, record: StepRecord) -> None:
        """Observers see the step; its stopped requests give their blocks back; drafts are guessed."""
        for observe in self.hooks["observe"]:
            observe(record)
        for request, status in record.stopped:
            self._finish(request, status)
        for propose in self.hooks["propose"]:                                    # 5. guess ahead
            propose(self.scheduler.running)

    def check_not_stalled(self, aborted: list[RequestOutput]) -> None:
        if self.scheduler.has_unfinished_requests() and not aborted:
            raise EngineStalled(self._why_stalled())

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self.scheduler.finish_request(request, status)
        self.token_selection.forget(request)
        for forget in self.hooks["forget"]:
            forget(request)

    def abort_step(self, scheduler_output: SchedulerOutput) -> None:
        """A step failed (a bug, out of memory, Ctrl-C): its requests end with "abort" and give
        their blocks back, so the engine serves the others, and later calls, correctly."""
        for request, _ in scheduler_output.scheduled:
            request_id = self.output_processor.request_id_of(request)
            if request_id is not None:
                self.abort_request(request_id)

    def _why_stalled(self) -> str:
        s, pool = self.scheduler, self.scheduler.block_pool
        first = s.waiting[0] if s.waiting else None
        return (f"no request can be scheduled: {len(s.waiting)} waiting, {len(s.running)} running, "
                f"{pool.num_free_blocks} of {pool.num_blocks} KV blocks free, max_num_seqs "
                f"{s.max_num_seqs}" + (f"; the oldest waiting request {first.request_id!r} has "
                                      f"{first.num_tokens} tokens" if first else ""))


class EngineStalled(RuntimeError):
    """Requests are queued but no step can schedule any of them: waiting would not help."""


# The hooks an extension may override that the engine keeps lists of (the others it calls once, at install).
HOOKS = ("block_hash_keys", "admit", "supply_blocks", "before_forward", "process_logits", "stop", "forget", "observe",
         "propose")
PARAM_FIELDS = frozenset(f.name for f in dataclass_fields(SamplingParams))   # request fields set on SamplingParams
