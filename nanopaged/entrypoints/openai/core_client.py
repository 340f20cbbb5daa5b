"""The API server's side of the engine core: EngineLoop's interface (engine_loop.py), over a socket.

The handlers cannot tell the two apart: `submit` tokenizes and checks a request on an input
thread, then waits until the engine took it; its outputs come to the submission's queue; `abort`
frees its blocks. What differs is where the engine is. Here it is another process
(engine_core.py), and one thread of this process owns the socket to it:

    send      each submission's requests, as token ids and SamplingParams' plain fields
    receive   each step's new token ids; detokenize them, find stop strings, build RequestOutputs
              exactly as the in-process engine would (the same OutputProcessor), hand them out
    watch     the engine core's life line: if it dies, every request in flight ends with an error

A command or a request's outputs that raise fail that request alone; if the thread itself dies,
the process exits (docs/08_server.md, "Faults").

So the text work of every client runs here, beside the engine's next step rather than before it.
A request stopped by a stop string is aborted in the engine core (its blocks go back); with
n > 1 only once every sample has stopped (the core's samples are one request there), so a sample
stopped early may run on in the core until its others end. vLLM: vllm/v1/engine/core_client.py
and async_llm.py. docs/08_server.md, "Processes".
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import queue
import sys
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import zmq

from nanopaged.core.request import Request, SampledToken
from nanopaged.engine.input_processor import InputProcessor
from nanopaged.engine.output_processor import OutputProcessor
from nanopaged.entrypoints import core_messages as m
from nanopaged.entrypoints.openai.engine_loop import (INPUT_THREADS, Submission, _post,
                                                      _refuse_past_context, _settle, drain)
from nanopaged.entrypoints.openai.protocol import OpenAIError, field_named, in_request_terms
from nanopaged.multimodal.chat_parts import chat_prompt
from nanopaged.multimodal.input_processor import MultiModalInputProcessor
from nanopaged.multimodal.media import png_bytes
from nanopaged.pooling.processors import PooledRequestOutput, PoolingInputProcessor
from nanopaged.pooling_params import PoolingParams
from nanopaged.worker.vision_runner import VISION_LANGUAGE_MODELS

logger = logging.getLogger("nanopaged.entrypoints.serve")
WATCH_MS = 200            # how often the socket thread looks at its parent while nothing arrives
# After the socket thread died (not of the engine core's death, which the supervisor handles): time for
# the errors it posted to reach their clients before this process exits.
EXIT_GRACE_S = 1.0


class CoreDied(ConnectionError):
    """The engine core's life line closed: the supervisor stops this server after a moment."""


class CoreClient:
    def __init__(self, name: str, address: str, config, tokenizer, num_kv_blocks: int, lifeline,
                 metrics=None, engine: str = "0") -> None:
        """`name`: this API server's name on the socket; `lifeline`: the read end of the pipe that
        only the engine core writes to (end of file: it died); `engine`: the core's index (/metrics' label)."""
        self.name, self.config, self.tokenizer, self.metrics, self.engine = name, config, tokenizer, metrics, engine
        self.on_figures = None                                 # figures(Figures): a data-parallel router's
        self.input_processor = InputProcessor(config, tokenizer, num_kv_blocks)
        if config.runner == "pooling":           # PoolingParams in, as the engine core's own processor takes them
            self.input_processor = PoolingInputProcessor(config, tokenizer, num_kv_blocks)
        if config.model_config.vision is not None:     # images: expanded here to count and check the tokens
            model_class = VISION_LANGUAGE_MODELS[config.model_config.architecture]
            self.input_processor = MultiModalInputProcessor(self.input_processor, model_class)
        self.outputs = OutputProcessor(tokenizer, [self._core_stopped])   # socket thread only, from here on
        self.core_stops = weakref.WeakKeyDictionary()          # sample -> its length when the core stopped it
        self.routes: dict[str, Submission] = {}                # request id -> its submission
        self.accepting: dict[Submission, set[str]] = {}        # request ids the core has not taken yet
        self.in_core: set[str] = set()                         # request ids the core still runs
        self.adapters: dict[int, Future] = {}                  # lora_int_id -> its load or unload
        self.error: BaseException | None = None
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.wake_r, self.wake_w = os.pipe()                   # a byte here: commands are waiting
        self.lifeline = lifeline
        self.inputs = ThreadPoolExecutor(INPUT_THREADS, thread_name_prefix="nanopaged-input")
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, name.encode())
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)
        self.thread = threading.Thread(target=self._run, name="nanopaged-core-client", daemon=True)
        self.parent = os.getppid()
        tokenizer.encode("warm-up")     # a fast tokenizer's first encode writes: done before threads share it

    # ---- the handlers' side (event loop), as EngineLoop's ------------------------------------------
    def start(self) -> None:
        self.thread.start()
        self._command(("send", m.Hello()))

    def stop(self) -> None:
        self._command(("stop",))
        self.thread.join(timeout=10)
        self.inputs.shutdown(wait=False, cancel_futures=True)

    @property
    def alive(self) -> bool:
        return self.error is None and self.thread.is_alive()

    def health(self) -> tuple[int, str]:
        return (200, "") if self.alive else (503, f"the engine core has stopped: {self.error}")

    async def submit(self, submission: Submission) -> None:
        await self.send(submission, await self.prepare(submission))

    async def prepare(self, submission: Submission) -> list[list[Request]]:
        """Tokenized and checked, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.inputs, self._process, submission)

    async def send(self, submission: Submission, batches: list[list[Request]]) -> None:
        """To the engine core; returns once it took every request (or refused one: OpenAIError)."""
        if not self.alive:
            raise OpenAIError(f"the engine core has stopped: {self.error}", status=503, type="service_unavailable")
        self._command(("add", submission, batches))
        await submission.accepted

    def abort(self, request_ids: list[str]) -> None:
        self._command(("abort", list(request_ids)))

    def _process(self, submission: Submission) -> list[list[Request]]:
        """Every prompt tokenized and checked here, as EngineLoop does; the engine core checks again
        what needs the engine (a grammar, an adapter) and may still refuse."""
        r = submission.request
        try:
            prompts = ([chat_prompt(self.tokenizer, conv, self.config) for conv in r.prompts] if r.kind == "chat"
                       else r.prompts)
            batches = [self.input_processor.process(rid, p, r.params)
                       for rid, p in zip(submission.request_ids, prompts)]
            for rid, p in zip(submission.request_ids, prompts):    # images cross the socket as plain bytes
                if isinstance(p, dict) and p.get("multi_modal_data"):
                    submission.media[rid] = (p["prompt"], [png_bytes(i) for i in p["multi_modal_data"]["image"]])
            if r.max_tokens_given:
                _refuse_past_context(batches, r, self.config.max_model_len)
        except ValueError as e:
            raise _as_openai_error(str(e), r) from None
        return batches

    # ---- LoRA adapters: the engine core reads them (served_models.py calls these, off the event loop) --
    def adapter(self, lora_request) -> None:
        self._adapter(m.Adapter(True, m.lora_to_wire(lora_request)))

    def unload(self, lora_int_id: int) -> None:
        self._adapter(m.Adapter(False, ["", lora_int_id, ""]))

    def _adapter(self, message: m.Adapter) -> None:
        done: Future = Future()
        self._command(("adapter", done, message))
        error = done.result(timeout=600)
        if error is not None:
            raise ValueError(error)

    # ---- the socket thread ---------------------------------------------------------------------------
    def _command(self, command: tuple) -> None:
        self.commands.put(command)
        os.write(self.wake_w, b"x")

    def _run(self) -> None:
        poller = zmq.Poller()
        for source in (self.socket, self.wake_r, self.lifeline.fileno()):
            poller.register(source, zmq.POLLIN)
        stopped = False
        try:
            while True:
                ready = dict(poller.poll(WATCH_MS))
                if self.lifeline.fileno() in ready:
                    raise CoreDied("the engine core died")
                if self.socket in ready:
                    self._receive()
                if self.wake_r in ready and not self._take_commands():
                    stopped = True
                    return
                if os.getppid() != self.parent:
                    raise ConnectionError("the server's supervisor died")
        except BaseException as e:
            self.error = e
            logger.error("nanopaged: %s; every request in flight ends with an error", e)
            if self.metrics is not None:
                self.metrics.engine_stopped(self.engine)
            self._fail_everyone(OpenAIError(f"engine core {self.engine}: {e}; its requests in flight end here",
                                            status=500, type="internal_server_error"))
        finally:
            if not stopped and not isinstance(self.error, CoreDied):
                _exit_process(self.error)

    def _take_commands(self) -> bool:
        os.read(self.wake_r, 4096)
        for command in drain(self.commands):
            if command[0] == "stop":
                return False
            try:
                self._carry_out(command)
            except (zmq.ZMQError, MemoryError):       # the socket or the process is broken: not one request's
                raise
            except Exception as e:                    # a bug met by one command: it fails alone
                logger.exception("a %s command failed", command[0])
                self._command_failed(command, e)
        return True

    def _carry_out(self, command: tuple) -> None:
        if command[0] == "add":
            self._add(command[1], command[2])
        elif command[0] == "abort":
            self._abort(command[1], tell_core=True)
        elif command[0] == "adapter":
            self.adapters[command[2].lora[1]] = command[1]
            self._send(command[2])
        else:
            self._send(command[1])

    def _command_failed(self, command: tuple, e: Exception) -> None:
        """The one submission (or adapter call) a failed command was about gets a 500; the thread goes on."""
        error = OpenAIError(f"internal error: {type(e).__name__}: {e}", status=500, type="internal_server_error")
        if command[0] == "add":
            for rid in command[1].request_ids:
                self.outputs.abort(rid)
            self.outputs.aborted.clear()
            self._refuse(command[1], error)
        elif command[0] == "adapter" and not command[1].done():
            self.adapters.pop(command[2].lora[1], None)
            command[1].set_result(error.message)

    def _send(self, message) -> None:
        self.socket.send(m.encode(message))

    def _add(self, submission: Submission, batches: list[list[Request]]) -> None:
        r = submission.request
        for samples in batches:
            rid = samples[0].request_id
            try:
                self.outputs.add(samples)
            except ValueError as e:                   # an id already in use (the server's are uuid4s)
                self._refuse(submission, OpenAIError(str(e)))
                return
            try:
                pooling = isinstance(r.params, PoolingParams)   # the pooling routes' (embeddings.py, classify.py, ...)
                prompt, images = submission.media.get(rid, (None, []))
                wire = m.encode(m.AddRequest(rid, samples[0].prompt_token_ids,
                                             {} if pooling else m.params_to_wire(r.params), samples[0].cache_salt,
                                             m.lora_to_wire(r.lora_request),
                                             m.params_to_wire(r.params) if pooling else None,
                                             submission.prefix_keys if rid == submission.request_ids[0] else [],
                                             prompt, images))
            except (TypeError, ValueError, OverflowError) as e:   # a value MessagePack cannot carry: its fault
                self.outputs.abort(rid)
                self.outputs.aborted.clear()
                self._refuse(submission, OpenAIError(f"the request cannot be sent to the engine: {e}"))
                return
            self.routes[rid] = submission
            self.in_core.add(rid)
            self.accepting.setdefault(submission, set()).add(rid)
            self.socket.send(wire)

    def _refuse(self, submission: Submission, error: OpenAIError) -> None:
        """All or none: a submission one of whose requests was refused gives back the others."""
        self.accepting.pop(submission, None)
        self._abort([rid for rid, s in self.routes.items() if s is submission], tell_core=True)
        _post(submission, _settle, submission.accepted, error)

    def _abort(self, request_ids: list[str], tell_core: bool) -> None:
        for rid in request_ids:
            if self.routes.pop(rid, None) is None:
                continue
            self.outputs.abort(rid)
            if self.metrics is not None and rid in self.metrics.arrival:
                self.metrics.aborted(rid)
            if tell_core and rid in self.in_core:
                self._send(m.Abort([rid]))
            self.in_core.discard(rid)
        self.outputs.aborted.clear()                  # the final outputs nobody is waiting for

    # ---- what the engine core says ---------------------------------------------------------------
    def _receive(self) -> None:
        while True:
            try:
                payload = self.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            message = m.client_decoder.decode(payload)
            if isinstance(message, m.Outputs):
                self._outputs(message)
            elif isinstance(message, m.Figures):
                if self.metrics is not None:
                    self.metrics.engine(message, self.engine)
                if self.on_figures is not None:
                    self.on_figures(message)
            elif isinstance(message, m.Accepted):
                self._accepted(message.request_id)
            elif isinstance(message, m.Refused):
                self._refused(message)
            elif isinstance(message, m.AdapterDone):
                done = self.adapters.pop(message.lora_int_id, None)
                if done is not None:
                    done.set_result(message.error)

    def _accepted(self, rid: str) -> None:
        submission = self.routes.get(rid)
        waiting = self.accepting.get(submission)
        if waiting is None:
            return
        waiting.discard(rid)
        if self.metrics is not None:
            self.metrics.arrived(rid, submission.arrival_time)
        if not waiting:
            del self.accepting[submission]
            _post(submission, _settle, submission.accepted, None)

    def _refused(self, message: m.Refused) -> None:
        self.in_core.discard(message.request_id)
        submission = self.routes.get(message.request_id)
        if submission is not None and submission in self.accepting:
            self._refuse(submission, _as_openai_error(message.message, submission.request))

    def _outputs(self, message: m.Outputs) -> None:
        if message.failed is not None:
            error = OpenAIError(message.failed, status=500, type="internal_server_error")
            for delta in message.deltas:
                submission = self.routes.get(delta.request_id)
                self.in_core.discard(delta.request_id)
                self._abort([delta.request_id], tell_core=False)
                if submission is not None:
                    _post(submission, submission.fail, error)
            return
        outputs = []
        for delta in message.deltas:
            if delta.request_id not in self.routes:
                continue
            try:
                outputs += self._outputs_of(delta)
            except Exception as e:                    # a bug met by one request's text: it fails alone
                logger.exception("the outputs of request %s failed", delta.request_id)
                self._fail_request(delta.request_id, e)
        if self.metrics is not None:
            self.metrics.outputs(outputs)
        by_submission: dict[Submission, list] = {}
        for output in outputs:
            submission = self.routes[output.request_id]
            by_submission.setdefault(submission, []).append(output)
            if output.finished:                        # a stop string, or the core's own end
                del self.routes[output.request_id]
                if output.request_id in self.in_core:
                    self.in_core.discard(output.request_id)
                    self._send(m.Abort([output.request_id]))
        for submission, items in by_submission.items():
            _post(submission, submission.put, items)

    def _outputs_of(self, delta: m.RequestDelta) -> list:
        sampled: dict[Request, list[SampledToken]] = {}
        self._apply(delta, sampled)
        outputs, _ = self.outputs.process(sampled)
        if delta.embedding is not None:
            outputs = [_with_vector(o, delta.embedding) for o in outputs]
        return outputs

    def _fail_request(self, rid: str, e: Exception) -> None:
        """Its submission ends with the error, and its other requests (other prompts) are aborted with it."""
        submission = self.routes.get(rid)
        self._abort([r for r, s in self.routes.items() if s is submission], tell_core=True)
        _post(submission, submission.fail, OpenAIError(f"internal error: {type(e).__name__}: {e}",
                                                       status=500, type="internal_server_error"))

    def _apply(self, delta: m.RequestDelta, sampled: dict) -> None:
        """A step's new tokens onto this side's copies of the request's samples, as the scheduler's
        update appends them in the core; the OutputProcessor takes them from there."""
        states = self.outputs.requests[delta.request_id]
        states[0].request.num_cached_tokens = delta.num_cached_tokens
        if delta.prompt_logprobs:
            entries = self.outputs.prompt_logprobs[delta.request_id]
            decode = states[0].request.sampling_params.detokenize
            entries += [self.outputs.logprob_dict(e, decode) for e in delta.prompt_logprobs if e is not None]
        if all(s.finish_reason is not None for s in delta.samples):
            self.in_core.discard(delta.request_id)
        for s in delta.samples:
            state = states[s.index]
            if not s.token_ids or state.finish_reason is not None:   # nothing new, or stopped here already
                continue
            request = state.request
            request.output_token_ids.extend(s.token_ids)
            if s.finish_reason == "stop" and s.stop_reason is None:   # EOS, or an extension's rule
                self.core_stops[request] = request.num_output_tokens
            tops = s.logprobs or [None] * len(s.token_ids)
            sampled[request] = [SampledToken(t, _logprob_of(t, top), None if top is None else [tuple(x) for x in top])
                                for t, top in zip(s.token_ids, tops)]

    def _core_stopped(self, request: Request) -> bool:
        """A stop rule (check_stop's rule 0): the core ended this sample here for a reason this side
        cannot see (a grammar's end; EOS gives the same answer either way)."""
        return self.core_stops.get(request) == request.num_output_tokens

    def _fail_everyone(self, error: OpenAIError) -> None:
        for submission in set(self.routes.values()):
            if submission in self.accepting:
                _post(submission, _settle, submission.accepted, error)
            _post(submission, submission.fail, error)
        self.routes.clear()
        for command in drain(self.commands):
            if command[0] == "add":
                _post(command[1], _settle, command[1].accepted, error)
            elif command[0] == "adapter":
                command[1].set_result(str(error.message))
        for done in self.adapters.values():
            done.set_result(str(error.message))


def _with_vector(output, embedding: list[float]):
    """A pooling request's output with its vector, as the in-process engine hands it out."""
    fields = {f.name: getattr(output, f.name) for f in dataclasses.fields(output)}
    return PooledRequestOutput(**fields, pooled=torch.tensor(embedding, dtype=torch.float32))


def _as_openai_error(message: str, r) -> OpenAIError:
    """A refusal in the client's terms, naming the field it is about (as EngineLoop does)."""
    param = field_named(message, constraint_field=r.constraint_field) or ("messages" if r.kind == "chat" else "prompt")
    return OpenAIError(in_request_terms(message, r.constraint_field), param=param)


def _logprob_of(token: int, top: list | None) -> float:
    """The sampled token's logprob: its entry in the top list (always there when logprobs are asked)."""
    if top is None:
        return 0.0
    return next((lp for t, lp, _ in top if t == token), 0.0)


def _exit_process(error: BaseException | None) -> None:
    """The socket thread is gone: this API server can answer nobody, so it exits (non-zero) for its
    supervisor to see, after a moment for the errors already posted to reach their clients."""
    print(f"nanopaged: the API server's engine-core thread died ({error!r}); exiting", file=sys.stderr, flush=True)
    time.sleep(EXIT_GRACE_S)
    os._exit(1)
