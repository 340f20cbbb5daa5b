"""EngineLoop's interface over N engine cores (`--data-parallel-size N`): one CoreClient each, and the router.

Each request is tokenized once, here, then the router (entrypoints/dp_router.py) picks the core from
its tokens and the figures every core publishes after each step, and that core's client takes it as
it would take any request. An abort goes to every client (one that does not know the id ignores it); a
LoRA adapter is loaded into every core. A core that dies fails its own requests (its client's life line
closes, core_client.py); the router stops choosing it and the others serve on; /health says which
died, until the supervisor has started another in its place (`replace`). docs/08_server.md, "Data parallelism".
"""
from __future__ import annotations

import threading

from nanopaged.entrypoints.dp_router import Router
from nanopaged.entrypoints.openai.core_client import CoreClient
from nanopaged.entrypoints.openai.engine_loop import Submission
from nanopaged.entrypoints.openai.protocol import OpenAIError


class DataParallelClient:
    def __init__(self, clients: list[CoreClient], router: Router, connect=None) -> None:
        """`connect(i, lifeline)`: a new client of core i (`replace`)."""
        self.clients, self.router, self.connect = clients, router, connect
        self.tokenizer = clients[0].tokenizer
        self.lock = threading.Lock()          # the router: the event loop chooses, the socket threads report
        for i, client in enumerate(clients):
            client.on_figures = self._figures_of(i)

    def _figures_of(self, core: int):
        def figures(f) -> None:
            with self.lock:
                self.router.figures(core, f.running, f.waiting, f.kv_usage)
                self.router.learn(core, f.prefix_keys)     # where every API server's requests went
        return figures

    def start(self) -> None:
        for client in self.clients:
            client.start()

    def stop(self) -> None:
        for client in self.clients:
            client.stop()

    @property
    def alive(self) -> bool:
        return any(client.alive for client in self.clients)

    def health(self) -> tuple[int, str]:
        dead = [i for i, client in enumerate(self.clients) if not client.alive]
        if len(dead) == len(self.clients):
            return 503, "every engine core has stopped"
        return 200, f"degraded: engine core(s) {', '.join(map(str, dead))} stopped" if dead else ""

    async def submit(self, submission: Submission) -> None:
        batches = await self.clients[0].prepare(submission)
        first = batches[0][0]
        lora = submission.request.lora_request
        with self.lock:
            for i, client in enumerate(self.clients):
                if not client.alive and self.router.loads[i].alive:     # once: it forgets the core's prefixes
                    self.router.died(i)
            keys = self.router.block_keys(first.prompt_token_ids, first.cache_salt, lora.lora_int_id if lora else 0)
            try:
                core = self.router.choose(keys)
            except ValueError as e:
                raise OpenAIError(str(e), status=503, type="service_unavailable") from None
        submission.prefix_keys = keys
        await self.clients[core].send(submission, batches)

    def replace(self, core: int, lifeline) -> None:
        """A new engine core took the dead one's place (the supervisor started it): a client for it."""
        client = self.connect(core, lifeline)
        client.on_figures = self._figures_of(core)
        client.start()
        old, self.clients[core] = self.clients[core], client
        with self.lock:
            self.router.revived(core)
        old.stop()

    def abort(self, request_ids: list[str]) -> None:
        for client in self.clients:
            client.abort(request_ids)

    def adapter(self, lora_request) -> None:
        for client in self.clients:
            client.adapter(lora_request)

    def unload(self, lora_int_id: int) -> None:
        for client in self.clients:
            client.unload(lora_int_id)
