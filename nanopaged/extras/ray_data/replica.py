"""EngineReplica: one Ray actor, one LLMEngine, kept full across the batches Ray hands it.

Ray Data calls `__call__` with one batch of rows at a time per call, but with several calls in
flight per actor (max_concurrent_batches): the actor is async, each call an asyncio task. If each
call ran `LLM.generate` on its batch, the engine would batch batch_size rows and idle between calls.
Instead every call drops its rows into the one engine and awaits them, so the engine's scheduler
sees the rows of every batch in flight at once, as continuous batching across batches (vLLM's
engine stage in ray.data.llm does the same with its async engine).

    Ray's calls (event loop)        queue rows, await their futures, yield the batch's rows out
    the engine thread               take queued rows, LLMEngine.step(), resolve finished rows

A call Ray cancels (its task cancelled) queues a Cancelled after its rows: the engine thread aborts
them, so a cancelled batch frees its blocks instead of generating to the end.

The engine thread is the only one that touches the engine, as in the server's engine loop
(entrypoints/openai/engine_loop.py). A row the engine refuses (ValueError) resolves as that row's
error at once. A failed step fails every row in flight, and their batches (Ray Data stops the
dataset on a batch's error: a step that fails is a bug to see). A bug in the thread itself ends the
process, and Ray restarts the replica and hands its batches to a live one, as for a killed replica.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import socket
import threading
import time
from dataclasses import dataclass

import torch

from nanopaged.engine.input_processor import render_chat
from nanopaged.extras.ray_data.rows import engine_result, params_of, prompt_of, result_row, rows_of, table_of
from nanopaged.llm import LLM, final_only

logger = logging.getLogger(__name__)


class EngineReplica:
    def __init__(self, model_source: str | None, engine_kwargs: dict, cpus: int,
                 sampling_params: dict | None = None) -> None:
        torch.set_num_threads(cpus)        # Ray reserved `cpus` for this actor; the engine uses that many
        started = time.monotonic()
        self.llm = LLM(model_source, **engine_kwargs, cpu_threads=None)
        self.load_s = time.monotonic() - started
        self.engine = self.llm.llm_engine
        self.default_params = sampling_params
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()      # (row, loop, future) from Ray's calls
        self.waiting: dict[str, tuple] = {}                      # request id -> (loop, future)
        self.request_ids = itertools.count()
        self.rows_done = 0
        self.busy_since: float | None = None                     # the first row's arrival (monotonic)
        self.busy_since_unix: float | None = None                # the same, on the wall clock
        self.where = {"node_id": node_id(), "hostname": socket.gethostname(), "pid": os.getpid()}
        threading.Thread(target=self._run, name="nanopaged-replica-engine", daemon=True).start()

    async def __call__(self, batch):
        """One batch in, the same rows out with their generations (rows.py). An async generator, as
        Ray Data wants from an async actor."""
        rows = rows_of(batch)
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in rows]
        for row, future in zip(rows, futures):
            self.inbox.put((row, loop, future))
        try:
            results = await asyncio.gather(*futures)   # a RequestOutput, or the row's error message
        except asyncio.CancelledError:                 # Ray cancelled the call: its rows stop generating
            self.inbox.put(Cancelled(frozenset(futures)))
            raise
        self.rows_done += len(rows)
        stats = self.stats()
        yield table_of([result_row(row, stats, error=r) if isinstance(r, str) else
                        result_row(row, stats, engine_result(r)) for row, r in zip(rows, results)])

    def stats(self) -> dict:
        """Where this replica runs and its engine's figures so far (each row out carries them). Read
        while the engine thread steps: plain counters only (get_stats walks tables a step may change)."""
        s = self.llm.stats
        elapsed = time.monotonic() - self.busy_since if self.busy_since else 0.0
        queries = s.prefix_cache_queries
        return {**self.where, "load_s": self.load_s, "busy_since_unix": self.busy_since_unix,
                "rows_done": self.rows_done, "num_generated_tokens": s.num_generated_tokens,
                "generation_tokens_per_s": s.num_generated_tokens / elapsed if elapsed else 0.0,
                "max_num_running": s.max_num_running, "num_preemptions": s.num_preemptions,
                "prefix_cache_hit_rate": s.prefix_cache_hits / queries if queries else 0.0,
                "peak_kv_cache_usage": s.peak_kv_blocks_used / self.engine.scheduler.block_pool.num_blocks}

    # ---- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._serve()
        except BaseException:     # a bug here, not in a row: end the process, so Ray restarts the replica
            logger.exception("the replica's engine thread failed; the replica exits and Ray restarts it")
            os._exit(1)

    def _serve(self) -> None:
        engine = self.engine
        while True:
            self._take(wait=not engine.has_unfinished_requests())
            if not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except Exception as e:            # the step's requests are aborted; fail every row in flight
                self._fail_all(e)
                continue
            for output in outputs:
                if output.finished and output.request_id in self.waiting:
                    loop, future = self.waiting.pop(output.request_id)
                    loop.call_soon_threadsafe(_settle, future, output)

    def _take(self, wait: bool) -> None:
        """Queue the rows Ray's calls have dropped in; block for the first when the engine is idle."""
        try:
            item = self.inbox.get() if wait else self.inbox.get_nowait()
            while True:
                if isinstance(item, Cancelled):
                    self._abort(item.futures)
                else:
                    self._add(*item)
                item = self.inbox.get_nowait()
        except queue.Empty:
            pass

    def _add(self, row: dict, loop, future) -> None:
        if self.busy_since is None:
            self.busy_since, self.busy_since_unix = time.monotonic(), time.time()
        request_id = str(next(self.request_ids))
        try:
            samples = self.engine.process_request(request_id, engine_prompt(self.engine, row),
                                                  final_only([params_of(row, self.default_params)])[0])
        except Exception as e:                   # this row's error (a ValueError naming the limit); the others go on
            loop.call_soon_threadsafe(_settle, future, message_of(e))
            return
        self.engine.queue(samples)
        self.waiting[request_id] = (loop, future)

    def _abort(self, futures: frozenset) -> None:
        """A cancelled call's rows, aborted in the engine (their blocks freed). They were queued before
        the Cancelled item, so each is in `waiting` or already settled."""
        for request_id in [rid for rid, (_, future) in self.waiting.items() if future in futures]:
            self.engine.abort_request(request_id)
            del self.waiting[request_id]

    def _fail_all(self, error: Exception) -> None:
        for request_id, (loop, future) in self.waiting.items():
            self.engine.abort_request(request_id)
            loop.call_soon_threadsafe(_fail, future, error)
        self.waiting.clear()


@dataclass(frozen=True)
class Cancelled:
    """In the inbox after a cancelled call's rows: abort those of these futures still running."""
    futures: frozenset


def engine_prompt(engine, row: dict):
    """The row's prompt as the engine takes it; messages through the model's chat template."""
    form, value = prompt_of(row)
    if form == "prompt":
        return value
    if form == "prompt_token_ids":
        return {"prompt_token_ids": value}
    # Arrow gives each message every key any message has: a key this one lacks is None.
    return render_chat(engine.tokenizer, [{k: v for k, v in m.items() if v is not None} for m in value])


def message_of(error: Exception) -> str:
    """A row's error column: a ValueError says what is wrong in its own words; anything else names its type."""
    return str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}"


def node_id() -> str | None:
    """The Ray node this replica runs on (None outside Ray: the tests drive a replica in-process too)."""
    try:
        import ray
        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except ImportError:
        return None


def _settle(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def _fail(future: asyncio.Future, error: Exception) -> None:
    if not future.done():
        future.set_exception(error)
