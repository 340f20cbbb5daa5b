"""ServerReplica: the rows of a batch through a running `nanopaged serve`, over its OpenAI API.

For users whose engines run as services: the processor is the same (processor.py), the rows in and
out are the same (rows.py), but a replica holds no model. It sends each row as one request,
/v1/completions for a prompt or token ids, /v1/chat/completions for messages, many at once
(max_concurrent_requests), and the server's engine batches them with everyone else's. vLLM's
extra field `return_token_ids` brings the tokens back beside the text. A sampling field the
server's API does not take is refused by name, never dropped.

A 4xx answer is the row's fault (the server named the field): it becomes the row's error; but a
401 or 403 (the key) and a 404 (the model's name) would be every row's, so they fail the batch, and
Ray stops the dataset with the server's message. Anything else (a 5xx, a refused connection, a
timeout) fails the batch too. A call Ray cancels closes its requests' connections: the server sees
each client leave and aborts its request.
"""
from __future__ import annotations

import asyncio
import dataclasses
import http.client
import json
import os
import socket
import threading
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

from nanopaged.entrypoints.openai.protocol import SAMPLING_FIELDS
from nanopaged.extras.ray_data.rows import params_of, prompt_of, result_row, rows_of, table_of
from nanopaged.sampling_params import SamplingParams

# SamplingParams' fields a server request carries: the server's own list (field -> SamplingParams
# name), and max_tokens, which it reads apart (chat also calls it max_completion_tokens).
BODY_FIELDS = {**SAMPLING_FIELDS, "max_tokens": "max_tokens"}
SENT = {*BODY_FIELDS.values(), "structured_outputs"}       # structured_outputs: vLLM's extra field
DEFAULTS = SamplingParams()
JOB_ERRORS = {401: "the API key", 403: "the API key", 404: "the model's name"}   # wrong for every row


class ServerReplica:
    def __init__(self, url: str, model: str | None, headers: dict, max_concurrent_requests: int,
                 sampling_params: dict | None, timeout_s: float) -> None:
        self.url, self.model, self.timeout_s = url, model, timeout_s
        parts = urllib.parse.urlsplit(url)
        self.connection = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        self.host, self.path = parts.netloc, parts.path
        self.headers = {"Content-Type": "application/json", **headers}
        self.default_params = sampling_params
        # http.client blocks: each request in flight holds a thread (asyncio's default pool has only a few)
        self.senders = ThreadPoolExecutor(max_concurrent_requests, thread_name_prefix="nanopaged-request")
        self.rows_done = 0
        self.where = {"hostname": socket.gethostname(), "pid": os.getpid(), "url": url}

    async def __call__(self, batch):
        rows = rows_of(batch)
        connections = Connections()
        try:
            outs = await asyncio.gather(*(self._one(row, connections) for row in rows))   # columns, or error
        finally:                      # cancelled, or failed: no row of this call keeps the server working
            connections.close()
        self.rows_done += len(rows)
        stats = {**self.where, "rows_done": self.rows_done}
        yield table_of([result_row(row, stats, error=out) if isinstance(out, str) else result_row(row, stats, out)
                        for row, out in zip(rows, outs)])

    async def _one(self, row: dict, connections: Connections):
        try:
            route, body = self.request_of(row)
        except ValueError as e:                      # checked here as the engine would, before any request
            return str(e)
        status, reply = await asyncio.get_running_loop().run_in_executor(
            self.senders, self.post, route, body, connections)
        message = reply.get("error", {}).get("message") or f"HTTP {status}"
        if status in JOB_ERRORS:
            raise RuntimeError(f"{self.url}{route} answered HTTP {status}: {message} (check {JOB_ERRORS[status]}: "
                               "no row can succeed)")
        if 400 <= status < 500:
            return message
        if status != 200:
            raise RuntimeError(f"{self.url}{route} answered HTTP {status}: {reply}")
        return server_result(reply, chat=route.endswith("chat/completions"))

    def request_of(self, row: dict) -> tuple[str, dict]:
        """The route and body for a row: its prompt and its sampling params, under the API's names."""
        form, prompt = prompt_of(row)
        params = params_of(row, self.default_params)
        check_sendable(params)
        body = {field: getattr(params, name) for field, name in BODY_FIELDS.items()}
        body["return_token_ids"] = True
        if params.structured_outputs is not None:
            body["structured_outputs"] = {k: v for k, v in vars(params.structured_outputs).items() if v is not None}
        if self.model is not None:
            body["model"] = self.model
        if form == "messages":
            return "/v1/chat/completions", {**body, "messages": prompt}
        return "/v1/completions", {**body, "prompt": prompt}

    def post(self, route: str, body: dict, connections: Connections) -> tuple[int, dict]:
        """One request, on a sender thread; (status, JSON reply, {} if the reply is not JSON)."""
        conn = self.connection(self.host, timeout=self.timeout_s)
        try:
            conn.connect()
            connections.add(conn)
            conn.request("POST", self.path + route, body=json.dumps(body).encode(), headers=self.headers)
            reply = conn.getresponse()
            status, data = reply.status, reply.read()
        finally:
            connections.discard(conn)
            conn.close()
        try:
            return status, json.loads(data)
        except ValueError:
            if status == 200:
                raise
            return status, {}


def check_sendable(params: SamplingParams) -> None:
    """A ValueError naming every field set away from its default that no request to the server carries
    (bad_words, logit_bias, allowed_token_ids, ...): the server's API has no such field."""
    unsent = [f.name for f in dataclasses.fields(SamplingParams)
              if f.init and f.name not in SENT and getattr(params, f.name) != getattr(DEFAULTS, f.name)]
    if unsent:
        raise ValueError(f"sampling_params {', '.join(unsent)}: not in the server's API (it takes "
                         f"{', '.join(sorted(SENT))}); run these rows on engine replicas (EngineProcessorConfig)")


class Connections:
    """The connections of one call's requests. Closing them ends the sender threads' reads at once and
    tells the server that each client left, so it aborts the request."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open: set = set()
        self.closed = False

    def add(self, conn) -> None:
        with self.lock:
            if self.closed:
                raise ConnectionAbortedError("the call was cancelled or failed")
            self.open.add(conn)

    def discard(self, conn) -> None:
        with self.lock:
            self.open.discard(conn)

    def close(self) -> None:
        with self.lock:
            self.closed = True
            conns = list(self.open)
        for conn in conns:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)     # wakes the thread blocked reading it
            except (AttributeError, OSError):            # its thread closed it meanwhile
                pass


def server_result(reply: dict, chat: bool) -> dict:
    """The output columns (rows.py) of a completion or chat reply made with return_token_ids."""
    [choice] = reply["choices"]
    tokens = choice["token_ids"]
    return {"generated_text": choice["message"]["content"] if chat else choice["text"],
            "generated_tokens": tokens, "num_input_tokens": reply["usage"]["prompt_tokens"],
            "num_generated_tokens": len(tokens), "finish_reason": choice["finish_reason"]}
