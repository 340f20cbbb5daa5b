"""Extension: the one way a feature attaches to the engine (docs/00_how_to_extend.md).

The core (block pool, scheduler, runner, engine step) knows no feature by name. A feature is a
subclass of `Extension` in its own folder, listed once in nanopaged/extensions.py. The engine installs
it when an engine setting asks for it (`wanted`) or when a request first sets one of its
`request_fields` (`late_install`), and then calls the methods it overrides, and only those, at fixed
points of a step, extensions in the order of the registry:

    the engine     check_config -> (model_stages, at load) -> attach
    add_request    prepare, block_hash_keys                 check and take a request's fields
    schedule       admit                                    may a waiting request join the running ones?
                   supply_blocks                            after its prefix hits: K/V of its next blocks?
    execute        before_forward                           per-step inputs the model reads
    select         process_logits, wrap_token_selection     masks; who chooses the tokens
    outputs        stop, forget                             is the output complete? a request ended
    after a step   observe, propose                         figures; tokens to verify next step
    get_stats      stats, reset_stats, progress             and /metrics: counters

An extension never assigns to the engine's attributes; what it needs from another extension it asks
for by type (`LLMEngine.find`), as a declared capability (`ForcedDrafts`), never by module name.
docs/00_how_to_extend.md lists which extension uses which hook.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

if TYPE_CHECKING:                      # type hints only: this module imports nothing of the package at run time
    import torch

    from nanopaged.config import EngineConfig
    from nanopaged.core.request import Request, RequestStatus, SampledToken
    from nanopaged.core.scheduler import SchedulerOutput
    from nanopaged.models.pipeline import ModelStage
    from nanopaged.outputs import RequestOutput
    from nanopaged.worker.model_runner import ModelInput, ModelRunnerOutput


class TokenSelection(Protocol):
    """The engine's own rule (sample/: ParallelSampler; an extension may wrap or replace it): it also
    learns of every request queued and finished."""

    def __call__(self, runner_output: ModelRunnerOutput) -> dict[Request, list[SampledToken]]: ...
    def add(self, samples: list[Request]) -> None: ...
    def forget(self, request: Request) -> None: ...


@dataclass
class StepRecord:
    """What one step did, for observers; taken before the stopped requests free their blocks."""
    scheduler_output: SchedulerOutput
    sampled: dict[Request, list[SampledToken]]
    outputs: list[RequestOutput]
    stopped: list[tuple[Request, RequestStatus]]
    running: list[Request]                  # the requests holding blocks during the step
    times: tuple[float, float, float, float]   # perf_counter at start, forward pass begun, sampled, updated
    phases: dict[str, float] = field(default_factory=dict)   # seconds: schedule, prepare, forward, sample, ...

    @property
    def num_tokens(self) -> int:
        """Tokens the step generated (with drafts, a request may get several)."""
        return sum(map(len, self.sampled.values()))


class Extension:
    """Every method is optional: the engine calls only those a subclass overrides (`overrides`)."""
    name: str = ""                      # its key in get_stats() and /metrics
    request_fields: tuple[str, ...] = ()   # SamplingParams fields or add_request keywords it implements

    # ---- installing --------------------------------------------------------------------------------------
    @classmethod
    def check_config(cls, config: EngineConfig) -> None:
        """Check (and resolve) its engine settings; a ValueError before any weight loads."""

    @classmethod
    def wanted(cls, config: EngineConfig) -> bool:
        """Installed with the engine? (A settings-driven extension says yes when its setting is set.)"""
        return False

    @classmethod
    def late_install(cls, config: EngineConfig, fields: dict) -> bool:
        """May a request that sets one of its fields (`fields`: the request's) install it into a running
        engine? False: the request goes on without it; a ValueError refuses the request (it needed a setting)."""
        return False

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    def model_stages(self) -> list[ModelStage]:
        """Its rewrites of the model, run once at load (only for extensions installed with the engine)."""
        return []

    def attach(self, engine) -> None:
        """`engine`, the LLMEngine: its runner, scheduler and tokenizer exist; look, keep references, change nothing."""

    # ---- one request ---------------------------------------------------------------------------------------
    def prepare(self, samples: list[Request], fields: dict) -> None:
        """Check and take a request's fields (`fields`: its add_request keywords) before it is queued;
        a ValueError refuses the request. Set `extension_fields` on every sample."""

    def block_hash_keys(self, request: Request) -> tuple:
        """What else a request's K/V depend on, mixed into its first block's hash (vLLM's extra keys)."""
        return ()

    def admit(self, request: Request, running: list[Request]) -> bool:
        """May this waiting request join the running ones now? (False: it waits, the next are tried.)"""
        return True

    def supply_blocks(self, request: Request, block_hashes: list[bytes]) -> list:
        """After the pool's prefix hits, the names of a waiting request's next full blocks, in order: the K/V of
        the first of them that it holds, one record each, in its own form (a tier beyond the pool; vLLM's KV
        connectors). The scheduler gives each a new block (`SchedulerOutput.blocks_to_fill`): the extension writes
        them into the KV cache in its `before_forward`. Asked again while the request waits for free blocks."""
        return []

    # ---- one step --------------------------------------------------------------------------------------------
    def before_forward(self, scheduler_output: SchedulerOutput, model_input: ModelInput) -> None:
        """The step's inputs are ready, the forward pass comes next."""

    def process_logits(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Row i is requests[i]'s; return the logits to choose from (leave the input as it is)."""
        return logits

    def wrap_token_selection(self, selection: TokenSelection) -> TokenSelection:
        """The rule that chooses tokens, wrapped (to verify guessed tokens) or replaced."""
        return selection

    def input_processor(self, default):
        """The input processor requests go through, replaced (other parameters than SamplingParams)."""
        return default

    def output_processor(self, default):
        """The output processor that builds outputs, replaced (outputs other than text)."""
        return default

    def stop(self, request: Request) -> bool:
        """Is the request's output complete after its newest token? (check_stop's rule 0)."""
        return False

    def forget(self, request: Request) -> None:
        """The request finished: drop what is kept for it."""

    def observe(self, record: StepRecord) -> None:
        """What the step did (its stopped requests still hold their blocks)."""

    def propose(self, running: list[Request]) -> None:
        """After the step: set running requests' `spec_token_ids` for the next one."""

    # ---- figures ---------------------------------------------------------------------------------------------
    def stats(self) -> dict | None:
        """Its figures since the last `reset_stats`, for get_stats()[name] and /metrics."""
        return None

    def reset_stats(self) -> None:
        """Count from now (the bench does, after its warm-up)."""

    def counters(self) -> dict[str, tuple[str, int | list[int]]]:
        """Its counters for /metrics, totals since the engine started: name -> (help, total, or a
        total per position)."""
        return {}

    def progress(self) -> str:
        """A short live figure for the progress bar ("" for none)."""
        return ""

    @classmethod
    def overrides(cls, method: str) -> bool:
        return getattr(cls, method) is not getattr(Extension, method)


class ForcedDrafts:
    """A capability an extension declares by subclassing it: it knows tokens a request must produce
    next (a constraint's forced continuation) and which guessed tokens it allows; an extension that
    proposes drafts finds it with `engine.find(ForcedDrafts)`, never by its name."""

    def forced_drafts(self, request: Request, most: int) -> list[int]:
        raise NotImplementedError

    def allowed_drafts(self, request: Request, forced: list[int], more: list[int]) -> list[int]:
        raise NotImplementedError


class StepObserver(Extension):
    """A function that sees every step's StepRecord and changes nothing: a test's probe, a benchmark's
    timer (`engine.install(StepObserver(fn))`, `engine.remove(...)` when done)."""

    def __init__(self, fn: Callable[["StepRecord"], None]) -> None:
        self.fn = fn

    def observe(self, record: StepRecord) -> None:
        self.fn(record)
