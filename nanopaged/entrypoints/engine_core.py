"""The engine-core process: the scheduler, the runner and the block pool, and a loop that feeds them.

    receive   new requests and aborts, from every API server, as they come (never waiting while work is queued)
    step      LLMEngine.step(): one step of every running request, all API servers' clients batched
    send      each step's new token ids to the API server that owns the request, and go on at once

It does no text work: the API servers tokenize before and detokenize after (core_messages.py's
`core_params`), so the model's steps are not queued behind JSON or a tokenizer. It listens on
one ZeroMQ ROUTER socket: each API server connects a DEALER under its own name, so one socket
takes every server's requests (ZeroMQ reads the peers in turn: none starves another) and
routes each answer back by name; an answer for a server that has gone is dropped, never waited
on. Requests are checked (structured outputs compile their grammar, LoRA reads its adapter) on
a few threads, so a slow schema delays no step; an Adapter message's read runs there too. A
message is refused alone: whatever checking one raises (a well-typed but hostile field, such as
lora=[] or a negative id) goes back to its sender as that request's error, and the loop serves on.
vLLM: vllm/v1/engine/core.py (EngineCoreProc). docs/08_server.md, "Processes".
"""
from __future__ import annotations

import logging
from collections import deque
import os
import signal
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import zmq

from nanopaged.entrypoints import core_messages as m
from nanopaged.lora.extension import LoRA
from nanopaged.lora.request import LoRARequest

logger = logging.getLogger("nanopaged.entrypoints.engine_core")
CHECK_THREADS = 2         # process_request beside the steps (tokenizer-free: a grammar, an adapter)
IDLE_POLL_MS = 100        # how long an idle loop waits for a message before it looks around again

MAX_PREFIX_KEYS = 4096     # prefix keys kept for the next figures (a router misses what falls off)

def run_engine_core(model: str | None, settings: dict, address: str, ready, lifeline, threads: int | None = None) -> None:
    """The process's body. `ready` (a Connection) hears ("ready", EngineConfig, num_kv_blocks) or
    ("error", text); `lifeline` is the write end of a pipe that only this process keeps open: when it
    dies, however it dies, every API server's read end reports end of file (api_server.py). `threads`:
    torch's CPU threads here (data parallelism splits the host's cores between the engine cores)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)       # Ctrl-C reaches the supervisor, which stops us
    if threads is not None:
        torch.set_num_threads(threads)
    from nanopaged.llm import LLM
    try:
        llm = LLM(model, **settings)
    except Exception as e:                             # a bad setting or model: the supervisor says which
        ready.send(("error", f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e)))
        raise SystemExit(1) from None
    core = EngineCore(llm, address)
    ready.send(("ready", llm.llm_engine.config, llm.llm_engine.runner.num_kv_blocks,
                llm.llm_engine.find(LoRA) is not None))
    ready.close()
    core.run()
    del lifeline                                      # closed with the process, on purpose


class EngineCore:
    def __init__(self, llm, address: str) -> None:
        self.llm, self.engine = llm, llm.llm_engine
        self.socket = zmq.Context.instance().socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(address)
        self.owner: dict[str, bytes] = {}             # request id -> the API server that sent it
        self.clients: set[bytes] = set()              # every API server that said Hello
        self.checking: list[tuple[bytes, m.AddRequest, Future]] = []   # in arrival order
        self.adapting: list[tuple[bytes, int, Future]] = []            # adapters read or dropped, any order
        self.checks = ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="nanopaged-check")
        self.prompt_sent: dict[str, int] = {}         # prompt_logprobs entries sent so far
        self.changed = True                           # since the last figures were sent
        self.prefix_keys = deque(maxlen=MAX_PREFIX_KEYS)   # of the requests taken since (data parallelism's routers)
        self.parent = os.getppid()

    # ---- the loop ------------------------------------------------------------------------------
    def run(self) -> None:
        with self.llm.one_call_at_a_time():           # the LLM's lock and its CPU thread governor
            while self.receive():
                self.queue_checked()
                self.send_adapters_done()
                if self.engine.has_unfinished_requests():
                    self.step()
                    self.changed = True
                if self.changed:                      # after every step: a scrape sees the gauges of now
                    self.send_figures()
                if os.getppid() != self.parent:       # the supervisor is gone (killed): so are we
                    logger.error("the supervisor died; the engine core stops")
                    break
        self.checks.shutdown(wait=False, cancel_futures=True)
        self.socket.close(linger=0)

    def receive(self) -> bool:
        """Every message waiting; if there is nothing to do, wait a while for one. False: shut down."""
        busy = self.engine.has_unfinished_requests() or self.checking or self.adapting
        timeout = 0 if self.engine.has_unfinished_requests() else 1 if busy else IDLE_POLL_MS
        if not self.socket.poll(timeout):
            return True
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return True
            try:
                client, payload = frames              # the sender's name (ROUTER adds it), the message
                message = m.core_decoder.decode(payload)
            except Exception as e:                    # not one of ours: say so, keep serving
                logger.error("dropped a malformed message from %r: %s", frames[0], e)
                continue
            if isinstance(message, m.Shutdown):
                return False
            try:
                self.handle(client, message)
            except Exception:                         # a bug's trace in the log; the others are served on
                logger.exception("a %s message from %r could not be handled", type(message).__name__, client)

    def handle(self, client: bytes, message) -> None:
        self.changed = True
        if isinstance(message, m.Hello):
            self.clients.add(client)
        elif isinstance(message, m.AddRequest):
            self.checking.append((client, message, self.checks.submit(self.check, message)))
        elif isinstance(message, m.Abort):
            for rid in message.request_ids:
                self.abort(rid)
        elif isinstance(message, m.ClientGone):
            gone = message.client.encode()
            self.clients.discard(gone)
            orphans = [rid for rid, owner in self.owner.items() if owner == gone]
            for rid in orphans:
                self.abort(rid)
            self.checking = [(c, msg, f) for c, msg, f in self.checking if c != gone]
            logger.warning("API server %s is gone: its %d running request(s) were aborted", message.client,
                           len(orphans))
        elif isinstance(message, m.Adapter):
            self.adapting.append((client, wire_id(message.lora), self.checks.submit(self.adapter, message)))

    def check(self, message: m.AddRequest):
        """On a check thread: the engine's own checks and preparation (nothing is queued here)."""
        prompt = {"prompt_token_ids": message.prompt_token_ids}
        if message.images:           # the processor places the images' tokens from the text (chat_parts.py)
            prompt = {"prompt": message.prompt, "multi_modal_data": {"image": list(message.images)}}
        if message.cache_salt is not None:
            prompt["cache_salt"] = message.cache_salt
        params = (m.pooling_from_wire(message.pooling) if message.pooling is not None
                  else m.core_params(message.params))
        lora = None if message.lora is None else lora_from_wire(message.lora)
        return self.engine.process_request(message.request_id, prompt, params, lora_request=lora)

    def queue_checked(self) -> None:
        """Queue the checked requests in the order they arrived (a later one waits for an earlier)."""
        while self.checking and self.checking[0][2].done():
            client, message, future = self.checking.pop(0)
            try:
                self.engine.queue(checked(future))
            except ValueError as e:
                self.send(client, m.Refused(message.request_id, str(e)))
                continue
            self.owner[message.request_id] = client
            self.prefix_keys.extend(message.prefix_keys)
            self.send(client, m.Accepted(message.request_id))

    def abort(self, request_id: str) -> None:
        if self.owner.pop(request_id, None) is not None:
            self.engine.abort_request(request_id)    # its blocks go back to the pool now
            self.prompt_sent.pop(request_id, None)

    def step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            # The engine aborted the step's requests and stays usable; end every request in flight
            # with the error, so no client waits for ever (as the one-process server does).
            logger.exception("a step failed; aborting the requests in flight")
            failed: dict[bytes, list] = {}
            for rid, client in list(self.owner.items()):
                failed.setdefault(client, []).append(m.RequestDelta(rid, [], 0))
                self.abort(rid)
            for client, deltas in failed.items():
                self.send(client, m.Outputs(deltas, failed=f"the engine failed: {type(e).__name__}: {e}"))
            return
        by_client: dict[bytes, list] = {}
        for output in outputs:
            client = self.owner.get(output.request_id)
            if client is None:                        # aborted: its client is gone or stopped it
                continue
            by_client.setdefault(client, []).append(self.delta(output))
            if output.finished:
                del self.owner[output.request_id]
                self.prompt_sent.pop(output.request_id, None)
        for client, deltas in by_client.items():
            self.send(client, m.Outputs(deltas))

    def delta(self, output) -> m.RequestDelta:
        samples = [m.SampleDelta(c.index, c.token_ids, _tops(c.logprobs), c.finish_reason, c.stop_reason)
                   for c in output.outputs]
        prompt = None
        if output.prompt_logprobs is not None:
            sent = self.prompt_sent.get(output.request_id, 0)
            prompt = [None if e is None else _top(e) for e in output.prompt_logprobs[sent:]]
            self.prompt_sent[output.request_id] = len(output.prompt_logprobs)
        pooled = getattr(output, "pooled", None)          # a pooling engine's vector (pooling/processors.py)
        return m.RequestDelta(output.request_id, samples, output.num_cached_tokens, prompt,
                              None if pooled is None else pooled.tolist())

    def adapter(self, message: m.Adapter) -> None:
        """On a check thread: read and check an adapter, or drop one (by its id alone) once no request
        uses it; a ValueError says why not."""
        lora = self.engine.find(LoRA)
        if lora is None:
            raise ValueError("the engine was started without enable_lora")
        manager = lora.manager
        if message.load:
            manager.adapter(lora_from_wire(message.lora))
        elif wire_id(message.lora) < 1:
            raise ValueError(f"an adapter to drop is named by an int id >= 1, got {str(message.lora)[:200]}")
        else:
            manager.unload(wire_id(message.lora))

    def send_adapters_done(self) -> None:
        """Each adapter read or dropped: an AdapterDone to its sender, with the reason if it failed."""
        done = [a for a in self.adapting if a[2].done()]
        self.adapting = [a for a in self.adapting if not a[2].done()]
        for client, lora_int_id, future in done:
            try:
                checked(future)
            except ValueError as e:
                self.send(client, m.AdapterDone(lora_int_id, str(e)))
                continue
            self.send(client, m.AdapterDone(lora_int_id))

    # ---- sending -------------------------------------------------------------------------------
    def send(self, client: bytes, message) -> None:
        try:
            self.socket.send_multipart([client, m.encode(message)], zmq.NOBLOCK)
        except zmq.ZMQError:                          # that server is gone or full: never wait on it
            pass

    def send_figures(self) -> None:
        self.changed = False
        figures = m.figures_of(self.engine, self.llm.stats)
        figures.prefix_keys = list(self.prefix_keys)
        self.prefix_keys.clear()
        for client in self.clients:
            self.send(client, figures)


def checked(future: Future):
    """A check's result; whatever it raised as a ValueError, so that it refuses its request alone."""
    try:
        return future.result()
    except ValueError:
        raise
    except Exception as e:
        logger.exception("checking a message failed")
        raise ValueError(f"the request could not be checked: {type(e).__name__}: {str(e)[:200]}") from None


def lora_from_wire(lora) -> LoRARequest:
    """[name, int id, path] as a LoRARequest (its own checks run); a ValueError for any other shape."""
    if not isinstance(lora, list) or len(lora) != 3 or not isinstance(lora[0], str) or not isinstance(lora[2], str):
        raise ValueError(f"lora must be [name, int id, path], got {str(lora)[:200]}")
    return LoRARequest(lora[0], lora[1], lora[2])


def wire_id(lora) -> int:
    """The int id in an Adapter message's [name, int id, path], for its answer; 0 where there is none."""
    ok = isinstance(lora, list) and len(lora) > 1 and type(lora[1]) is int
    return lora[1] if ok else 0


def _top(entry: dict) -> list:
    return [[token, lp.logprob, lp.rank] for token, lp in entry.items()]


def _tops(logprobs: list | None) -> list | None:
    return None if logprobs is None else [_top(e) for e in logprobs]
