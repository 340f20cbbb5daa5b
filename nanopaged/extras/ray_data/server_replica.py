"""ServerReplica: the rows of a batch through a running `nanopaged serve`, over its OpenAI API.

For users whose engines run as services: the processor is the same (processor.py), the rows in and
out are the same (rows.py), but a replica holds no model. It sends each row as one request,
/v1/completions for a prompt or token ids, /v1/chat/completions for messages, many at once
(max_concurrent_requests), and the server's engine batches them with everyone else's. vLLM's
extra field `return_token_ids` brings the tokens back beside the text.

A 4xx answer is the row's fault (the server named the field): it becomes the row's error. Anything
else (a 5xx, a refused connection, a timeout) is the service's: the batch fails and Ray retries it.
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from nanopaged.entrypoints.openai.protocol import SAMPLING_FIELDS
from nanopaged.extras.ray_data.rows import params_of, prompt_of, result_row, rows_of, table_of

# SamplingParams' fields a server request carries: the server's own list (field -> SamplingParams
# name), and max_tokens, which it reads apart (chat also calls it max_completion_tokens).
BODY_FIELDS = {**SAMPLING_FIELDS, "max_tokens": "max_tokens"}


class ServerReplica:
    def __init__(self, url: str, model: str | None, headers: dict, max_concurrent_requests: int,
                 sampling_params: dict | None, timeout_s: float) -> None:
        self.url, self.model, self.timeout_s = url, model, timeout_s
        self.headers = {"Content-Type": "application/json", **headers}
        self.default_params = sampling_params
        # urllib blocks: each request in flight holds a thread (asyncio's default pool has only a few)
        self.senders = ThreadPoolExecutor(max_concurrent_requests, thread_name_prefix="nanopaged-request")
        self.rows_done = 0
        self.where = {"hostname": socket.gethostname(), "pid": os.getpid(), "url": url}

    async def __call__(self, batch):
        rows = rows_of(batch)
        outs = await asyncio.gather(*(self._one(row) for row in rows))   # (output columns, or error)
        self.rows_done += len(rows)
        stats = {**self.where, "rows_done": self.rows_done}
        yield table_of([result_row(row, stats, error=out) if isinstance(out, str) else result_row(row, stats, out)
                        for row, out in zip(rows, outs)])

    async def _one(self, row: dict):
        try:
            route, body = self.request_of(row)
        except ValueError as e:                      # checked here as the engine would, before any request
            return str(e)
        status, reply = await asyncio.get_running_loop().run_in_executor(self.senders, self.post, route, body)
        if 400 <= status < 500:
            return reply.get("error", {}).get("message") or f"HTTP {status}"
        if status != 200:
            raise RuntimeError(f"{self.url}{route} answered HTTP {status}: {reply}")
        return server_result(reply, chat=route.endswith("chat/completions"))

    def request_of(self, row: dict) -> tuple[str, dict]:
        """The route and body for a row: its prompt and its sampling params, under the API's names."""
        form, prompt = prompt_of(row)
        params = params_of(row, self.default_params)
        body = {field: getattr(params, name) for field, name in BODY_FIELDS.items()}
        body["return_token_ids"] = True
        if params.structured_outputs is not None:
            body["structured_outputs"] = {k: v for k, v in vars(params.structured_outputs).items() if v is not None}
        if self.model is not None:
            body["model"] = self.model
        if form == "messages":
            return "/v1/chat/completions", {**body, "messages": prompt}
        return "/v1/completions", {**body, "prompt": prompt}

    def post(self, route: str, body: dict) -> tuple[int, dict]:
        """One request, on a sender thread; (status, JSON reply)."""
        request = urllib.request.Request(self.url + route, data=json.dumps(body).encode(), headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                return reply.status, json.loads(reply.read())
        except urllib.error.HTTPError as e:
            try:
                return e.code, json.loads(e.read())
            except ValueError:
                return e.code, {}


def server_result(reply: dict, chat: bool) -> dict:
    """The output columns (rows.py) of a completion or chat reply made with return_token_ids."""
    [choice] = reply["choices"]
    tokens = choice["token_ids"]
    return {"generated_text": choice["message"]["content"] if chat else choice["text"],
            "generated_tokens": tokens, "num_input_tokens": reply["usage"]["prompt_tokens"],
            "num_generated_tokens": len(tokens), "finish_reason": choice["finish_reason"]}
