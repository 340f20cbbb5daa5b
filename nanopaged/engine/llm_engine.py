"""LLMEngine: requests in, one step at a time, RequestOutputs out.

    add_request   tokenize and validate (input_processor.py), then queue the request
    step          schedule -> execute -> update -> outputs

All validation happens before a request is queued: one that can never run raises
ValueError and the engine goes on serving the others. `LLM.generate` (llm.py) is a loop
over `step`; drive the engine directly to stream. docs/00_how_to_read.md walks one step.

Extensions reach the engine through its hooks: `step(select_tokens)` takes a token-selection
rule in place of `token_selection` for one step (beam search; `track` follows the sequences it
forks), every function in `observers` sees each step's `StepRecord` (statistics, the bench),
and `make_runner` builds another runner with ModelRunner's interface (tensor parallelism).
A SamplingParams field can also turn an extension on (FIELD_EXTENSIONS: structured outputs): it
is installed the first time a request sets the field and adds a logits processor and a stop
rule (`add_logits_processor`, `add_stop_rule`). An engine setting can too (CONFIG_EXTENSIONS:
speculative decoding), installed with the engine: it replaces `token_selection` and adds a
proposer, a function in `proposers` that each step ends with, guessing the running requests'
next tokens.
"""
from __future__ import annotations

import importlib
import threading
import time
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Protocol

from nanopaged.config import EngineConfig
from nanopaged.core.block_pool import BlockPool
from nanopaged.core.request import Request, RequestStatus, SampledToken
from nanopaged.core.scheduler import Scheduler, SchedulerOutput
from nanopaged.engine.input_processor import InputProcessor, PromptType, load_tokenizer
from nanopaged.engine.output_processor import OutputProcessor, StopRule
from nanopaged.outputs import RequestOutput
from nanopaged.sample.logits_processors import LogitsProcessor
from nanopaged.sample.parallel_sampling import ParallelSampler
from nanopaged.sample.sampler import Sampler
from nanopaged.sampling_params import SamplingParams
from nanopaged.worker.model_runner import ModelRunner, ModelRunnerOutput

# A token-selection rule: each sampling request's tokens this step (one; with drafts, those accepted and one more)
SelectTokens = Callable[[ModelRunnerOutput], dict[Request, list[SampledToken]]]


class TokenSelection(Protocol):
    """The engine's own rule (sample/: ParallelSampler, or RejectionSampler with drafts): it also
    learns of every request queued and finished."""

    def __call__(self, runner_output: ModelRunnerOutput) -> dict[Request, list[SampledToken]]: ...
    def add(self, samples: list[Request]) -> None: ...
    def forget(self, request: Request) -> None: ...


# SamplingParams fields that an extension beside the engine implements: its module's `install(engine)`
# runs when a request first sets the field, and returns what `prepare`s each such request.
FIELD_EXTENSIONS = {"structured_outputs": "nanopaged.structured_output"}
# EngineConfig fields that do the same: installed when the engine is built, if set
CONFIG_EXTENSIONS = {"speculative_config": "nanopaged.spec_decode", "enable_lora": "nanopaged.lora",
                     "pooler_config": "nanopaged.pooling"}


@dataclass
class StepRecord:
    """What one step did, for observers; taken before the stopped requests free their blocks."""
    scheduler_output: SchedulerOutput
    sampled: dict[Request, list[SampledToken]]
    outputs: list[RequestOutput]
    stopped: list[tuple[Request, RequestStatus]]
    running: list[Request]                  # the requests holding blocks during the step
    times: tuple[float, float, float, float]   # perf_counter at start, scheduled, executed, updated

    @property
    def num_tokens(self) -> int:
        """Tokens the step generated (with drafts, a request may get several)."""
        return sum(map(len, self.sampled.values()))


class LLMEngine:
    def __init__(self, config: EngineConfig,
                 make_runner: Callable[[EngineConfig], ModelRunner] = ModelRunner) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config.tokenizer)
        self.runner = make_runner(config)
        block_pool = BlockPool(self.runner.num_kv_blocks, config.block_size,
                               config.enable_prefix_caching, config.prefix_hash)
        self.scheduler = Scheduler(block_pool, config.max_num_seqs, config.max_num_batched_tokens)
        self.input_processor = InputProcessor(config, self.tokenizer, self.runner.num_kv_blocks)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.sampler = Sampler(self.runner.device, config.seed, self.runner.fast_path.argmax)
        self.token_selection: TokenSelection = ParallelSampler(self.sampler)
        self.observers: list[Callable[[StepRecord], None]] = []
        self.proposers: list[Callable[[list[Request]], None]] = []   # set running requests' spec_token_ids
        self.extensions: dict[str, object] = {}            # the extensions installed so far, by module
        self._installing = threading.Lock()
        for name, module in CONFIG_EXTENSIONS.items():
            if getattr(config, name) not in (None, False):
                self.extension(module)

    def get_tokenizer(self):
        return self.tokenizer

    def add_logits_processor(self, processor: LogitsProcessor) -> None:
        """An extension's processor sees each step's logits before anything is chosen, under every
        token-selection rule (sample/logits_processors.py)."""
        self.sampler.logits_processors.append(processor)

    def add_stop_rule(self, rule: StopRule) -> None:
        """An extension's rule says when a request's output is complete (check_stop's rule 0)."""
        self.output_processor.stop_rules.append(rule)

    @cached_property
    def model_config(self):
        """vLLM's ModelConfig, with the names its clients read (nanopaged/vllm_compat.py)."""
        from nanopaged.vllm_compat import VllmModelConfig
        return VllmModelConfig(self.config)

    # ---- requests in ----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    lora_request=None) -> None:
        self.queue(self.process_request(request_id, prompt, params, lora_request))

    def process_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                        lora_request=None) -> list[Request]:
        """Tokenize and validate without queueing: the request's n sequences, or a ValueError.
        A `lora_request` (a LoRARequest) is checked and its adapter read by the LoRA extension."""
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {request_id!r}")
        samples = self.input_processor.process(request_id, prompt, params)
        if lora_request is not None:
            if "nanopaged.lora" not in self.extensions:
                raise ValueError(f"lora_request={lora_request!r} needs an engine made with enable_lora=True")
            self.extensions["nanopaged.lora"].prepare(samples, lora_request)
        for name, module in FIELD_EXTENSIONS.items():
            if getattr(samples[0].sampling_params, name) is not None:
                self.extension(module).prepare(samples)     # its own checks and work, before any queueing
        return samples

    def extension(self, module: str):
        """The extension in `module`, installed into this engine on first use (under a lock: the
        server processes requests on several threads); a ValueError if it cannot be."""
        with self._installing:
            if module not in self.extensions:
                self.extensions[module] = importlib.import_module(module).install(self)
            return self.extensions[module]

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
        that advanced. `select_tokens` replaces the sampler (beam search chooses its own); it
        must give every row a token, unless its caller aborts that request before the next step.
        If the step fails, its requests end with "abort" and the error goes on to the caller."""
        aborted, self.output_processor.aborted = self.output_processor.aborted, []
        t0 = time.perf_counter()
        scheduler_output = self.scheduler.schedule()                                 # 1. schedule
        if not scheduler_output.scheduled:
            if self.scheduler.has_unfinished_requests() and not aborted:
                raise EngineStalled(self._why_stalled())
            return aborted
        try:
            t1 = time.perf_counter()
            runner_output = self.runner.execute(scheduler_output)                    # 2. execute
            sampled = (select_tokens or self.token_selection)(runner_output)
            t2 = time.perf_counter()
            self.scheduler.update(scheduler_output, sampled)                         # 3. update
            t3 = time.perf_counter()
            outputs, stopped = self.output_processor.process(sampled, runner_output.prompt_logits)  # 4. outputs
            record = StepRecord(scheduler_output, sampled, outputs, stopped, self.scheduler.running,
                                (t0, t1, t2, t3))
            for observer in self.observers:
                observer(record)
            for request, status in stopped:
                self._finish(request, status)
            for propose in self.proposers:                                           # 5. guess ahead
                propose(self.scheduler.running)
        except BaseException:
            self._abort_step(scheduler_output)
            raise
        return aborted + outputs

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self.scheduler.finish_request(request, status)
        self.token_selection.forget(request)

    def _abort_step(self, scheduler_output: SchedulerOutput) -> None:
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
