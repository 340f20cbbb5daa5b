"""The engine loop: one thread owns the LLMEngine and steps it; HTTP handlers never do.

Handlers run on the server's asyncio event loop, many at once; a model step takes
milliseconds to seconds. If a handler stepped the engine, every other client would wait
on it, and two handlers could step at once. So the engine lives on a thread of its own
that does three things, over and over:

    take commands      new requests (already tokenized and checked) and aborts, from a queue
    step               LLMEngine.step(): one step of every running request, all clients batched
    hand out outputs   each RequestOutput goes to its submission, where it replaces one not read yet

Tokenizing, the chat template and the checks run before that, on a pool of input threads,
so a 1 MB prompt (a second of tokenizing) delays no one else's tokens. Requests from all
clients meet in the one scheduler, exactly as `LLM.generate`'s do. vLLM splits the same
roles between processes: vllm/v1/engine/async_llm.py (the handlers' side, tokenizing and
the per-request output queues) and vllm/v1/engine/core.py (the busy loop that steps).
docs/08_server.md.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from nanopaged.core.request import Request
from nanopaged.engine.llm_engine import LLMEngine
from nanopaged.entrypoints.core_messages import figures_of
from nanopaged.entrypoints.openai.protocol import OpenAIError, ParsedRequest, field_named, in_request_terms
from nanopaged.multimodal.chat_parts import chat_prompt
from nanopaged.outputs import RequestOutput

logger = logging.getLogger("nanopaged.entrypoints.serve")
# Threads that tokenize and check requests. The tokenizer releases the GIL, so they run beside
# the engine thread; several, so that a short prompt is not queued behind a long one; few, as
# each long prompt holds its tokens while it is checked (8 MiB of text: up to ~1.6 GB at peak).
INPUT_THREADS = 4


@dataclass(eq=False)            # identity: a submission is a key of the loop's tables
class Submission:
    """One HTTP request on its way through the engine: its engine requests (one per prompt),
    and where their outputs go. Made and read on the event loop; the engine thread only
    posts into it through `loop.call_soon_threadsafe`.

    At most one output per request waits here, however slowly the client reads: the server's
    outputs are cumulative (each holds all the text so far), so a newer one holds everything an
    unread older one does and replaces it (vLLM: RequestOutputCollector)."""
    request: ParsedRequest
    request_ids: list[str]                    # one per prompt
    loop: asyncio.AbstractEventLoop
    arrival_time: float = field(default_factory=time.monotonic)
    accepted: asyncio.Future = None           # None once queued, or the OpenAIError that refused it
    pending: dict = field(default_factory=dict)       # request id -> its newest unread RequestOutput
    error: BaseException | None = None        # ends the results once the pending outputs are read
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    prefix_keys: list = field(default_factory=list)   # data parallelism: its first prompt's keys (dp_router.py)
    media: dict = field(default_factory=dict)         # engine core: request id -> (prompt text, images as PNG bytes)

    def __post_init__(self) -> None:
        if self.accepted is None:
            self.accepted = self.loop.create_future()

    def put(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            self.pending[output.request_id] = output
        self.ready.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.ready.set()

    async def results(self):
        """The RequestOutputs of this submission's requests (cumulative, vLLM's default), as they
        come, until every one has finished."""
        unfinished = set(self.request_ids)
        while unfinished:
            await self.ready.wait()
            self.ready.clear()
            items, self.pending = list(self.pending.values()), {}
            for item in items:
                if item.finished:
                    unfinished.discard(item.request_id)
                yield item
            if self.error is not None and unfinished:
                raise self.error


class EngineLoop:
    def __init__(self, engine: LLMEngine, metrics=None, hold=contextlib.nullcontext, stats=None) -> None:
        """`metrics` (metrics.py) hears of arrivals, aborts and outputs, and gets the engine's
        figures after every round (`stats`: the LLM's EngineStats); `hold` is a context the whole
        loop runs in (LLM.one_call_at_a_time: the LLM's lock, and its CPU thread governor on this thread)."""
        self.engine, self.metrics, self.hold, self.stats = engine, metrics, hold, stats
        self.tokenizer = engine.tokenizer                     # /tokenize reads it (encode and decode only)
        # ("add", Submission, its processed requests) | ("abort", ids) | ("stop",)
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.routes: dict[str, Submission] = {}              # engine thread only: request id -> its submission
        self.error: BaseException | None = None               # why the loop died, if it did
        self.thread = threading.Thread(target=self._run, name="nanopaged-engine-loop", daemon=True)
        self.inputs = ThreadPoolExecutor(INPUT_THREADS, thread_name_prefix="nanopaged-input")
        # A fast tokenizer's first encode resets any truncation or padding its tokenizer.json sets:
        # a write, which fails ("Already borrowed", vLLM issue #40949) if another thread uses the
        # tokenizer meanwhile. Done once here; from then on encode and decode only read.
        engine.tokenizer.encode("warm-up")

    # ---- the handlers' side (event loop) -------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.inbox.put(("stop",))
        self.thread.join(timeout=30)
        self.inputs.shutdown(wait=False, cancel_futures=True)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def health(self) -> tuple[int, str]:
        return (200, "") if self.alive else (503, "the engine has stopped")

    async def submit(self, submission: Submission) -> None:
        """Tokenize and check its requests on an input thread, then queue them; returns once the
        engine took them, or raises the OpenAIError that refused them (a prompt too long, a bad
        chat message, ...)."""
        batches = await asyncio.get_running_loop().run_in_executor(self.inputs, self._process, submission)
        if not self.alive:
            raise OpenAIError(f"the engine loop has stopped: {self.error!r}", status=503,
                              type="service_unavailable")
        self.inbox.put(("add", submission, batches))
        await submission.accepted

    def abort(self, request_ids: list[str]) -> None:
        """The client is gone: free these requests' blocks at once (a no-op for finished ones)."""
        self.inbox.put(("abort", request_ids))

    # ---- the input threads -----------------------------------------------------------------------
    def _process(self, submission: Submission) -> list[list[Request]]:
        """Every prompt tokenized and checked, all or none (as LLM.generate), or an OpenAIError.
        Safe beside the engine thread's steps: process_request reads only the fixed config and
        the tokenizer, whose encode may run on several threads at once, compiles a request's
        constraint (structured outputs: a cache with its own lock, so a slow schema stalls no step)
        and reads its LoRA adapter if it is not in memory (the LoRA manager's lock); queueing, which
        changes the engine, is left to the engine thread."""
        r, engine = submission.request, self.engine
        try:
            prompts = ([chat_prompt(engine.tokenizer, conv, engine.config) for conv in r.prompts]
                       if r.kind == "chat" else r.prompts)
            batches = [engine.process_request(rid, p, r.params, lora_request=r.lora_request)
                       for rid, p in zip(submission.request_ids, prompts)]
            if r.max_tokens_given:
                _refuse_past_context(batches, r, engine.config.max_model_len)
        except ValueError as e:
            param = field_named(str(e), constraint_field=r.constraint_field) or (
                "messages" if r.kind == "chat" else "prompt")
            raise OpenAIError(in_request_terms(str(e), r.constraint_field), param=param) from None
        return batches

    # ---- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            with self.hold():
                while self._take_commands(block=not self.engine.has_unfinished_requests()):
                    if self.engine.has_unfinished_requests():
                        self._step()
                    if self.metrics is not None:
                        self.metrics.engine(figures_of(self.engine, self.stats))
        except BaseException as e:            # a bug in the loop itself: /health says so
            self.error = e
            logger.exception("the engine loop died")
            self._fail_everyone(OpenAIError(f"the engine loop died: {type(e).__name__}: {e}", status=500,
                                            type="internal_server_error"))

    def _fail_everyone(self, error: OpenAIError) -> None:
        """No client waits for ever on a dead loop: running requests get the error in their
        stream, queued ones instead of their acceptance."""
        for submission in set(self.routes.values()):
            _post(submission, submission.fail, error)
        for command in drain(self.inbox):
            if command[0] == "add":
                _post(command[1], _settle, command[1].accepted, error)

    def _take_commands(self, block: bool) -> bool:
        """Carry out every queued command (waiting for one if the engine is idle); False on stop."""
        commands = [self.inbox.get()] if block else []
        for command in commands + drain(self.inbox):
            if command[0] == "stop":
                return False
            try:
                if command[0] == "add":
                    self._add(command[1], command[2])
                else:
                    self._abort(command[1])
            except Exception as e:            # a bug met by one command: its submission fails alone
                logger.exception("a %s command failed", command[0])
                if command[0] == "add":
                    self._abort(command[1].request_ids)
                    _post(command[1], _settle, command[1].accepted, OpenAIError(
                        f"internal error: {type(e).__name__}: {e}", status=500, type="internal_server_error"))
        return True

    def _add(self, submission: Submission, batches: list[list[Request]]) -> None:
        """Queue a submission's processed requests, all or none; the engine thread's only part."""
        engine, queued = self.engine, []
        try:
            for samples in batches:
                engine.queue(samples)
                queued.append(samples[0].request_id)
        except ValueError as e:          # a request id already in use (the server's are uuid4s)
            for rid in queued:
                engine.abort_request(rid)
            _post(submission, _settle, submission.accepted, OpenAIError(str(e)))
            return
        for rid in queued:
            self.routes[rid] = submission
            if self.metrics is not None:
                self.metrics.arrived(rid, submission.arrival_time)
        _post(submission, _settle, submission.accepted, None)

    def _abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if self.routes.pop(rid, None) is not None:
                self.engine.abort_request(rid)      # blocks back to the pool now
                if self.metrics is not None:
                    self.metrics.aborted(rid)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            # The engine aborted the step's requests and stays usable (core/engine.py); end
            # every request in flight with the error, so no client waits for ever.
            logger.exception("a step failed; aborting the requests in flight")
            error = OpenAIError(f"the engine failed: {type(e).__name__}: {e}", status=500,
                                type="internal_server_error")
            for rid, submission in list(self.routes.items()):
                self._abort([rid])
                _post(submission, submission.fail, error)
            return
        self._hand_out(outputs)

    def _hand_out(self, outputs: list[RequestOutput]) -> None:
        """Each output to its submission's queue: one call into the event loop per submission."""
        by_submission: dict[Submission, list[RequestOutput]] = {}
        for output in outputs:
            submission = self.routes.get(output.request_id)
            if submission is None:                  # aborted: its client is gone
                continue
            by_submission.setdefault(submission, []).append(output)
            if output.finished:
                del self.routes[output.request_id]
        if self.metrics is not None:
            self.metrics.outputs(outputs)
        for submission, items in by_submission.items():
            _post(submission, submission.put, items)


def _refuse_past_context(batches: list, r: ParsedRequest, max_model_len: int) -> None:
    """An explicit max_tokens that the context cannot hold is a 400, as in vLLM's server
    (offline, `LLM.generate` clips it instead)."""
    for samples in batches:
        first = samples[0]
        if first.max_tokens < r.params.max_tokens:
            raise ValueError(f"max_tokens={r.params.max_tokens} plus the prompt's {first.num_prompt_tokens} "
                             f"tokens is more than max_model_len={max_model_len}; ask for at most "
                             f"{first.max_tokens} tokens")


def drain(q: queue.SimpleQueue) -> list:
    """Everything waiting in `q` now, without waiting for more."""
    items = []
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            return items


def _post(submission: Submission, fn, *args) -> None:
    """Run fn(*args) on the submission's event loop (asyncio objects are not thread-safe)."""
    try:
        submission.loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:                       # the event loop has closed: the server is stopping
        pass


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():                          # the handler gave up waiting (its client left)
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
