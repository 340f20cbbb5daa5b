"""Data parallelism's routing rule: which engine core a new request goes to (`--dp-routing`).

With `--data-parallel-size N` every API server is connected to N engine cores, each with its own
scheduler, block pool and copy of the model. Each core publishes its figures after every step
(core_messages.Figures: running, waiting, KV usage), to every API server, and each API server routes
its new requests on them (the coordinator's rule, run where the request is):

    round-robin     each core in turn, whatever it holds
    least-loaded    the core with the fewest requests (running + waiting + sent but not yet counted
                    there), then the least KV usage
    prefix-aware    the core that holds the longest run of the request's first blocks, if that run is
                    longer than the least loaded core's by at least half the blocks looked at (llm-d's
                    prefix-cache-aware routing) and the core is not overloaded (more than twice the least
                    loaded core's requests and OVERLOAD more); otherwise least-loaded. (The default.) A
                    shared preamble alone does not draw a new system prompt to one core: those spread.

A core "holds" a prefix when it took a request that began with the same blocks: the key of a block is
the block pool's own chained hash (core/block_pool.py: hash_block) of its tokens, with the request's
cache salt and adapter in the first, so a different salt or adapter is another prefix. A request
carries its keys to its core (AddRequest.prefix_keys), and the core hands them back in its next figures
to every API server, so each router learns where every server's requests went. The memory is bounded
(PREFIX_MEMORY keys, least recently used forgotten), and a core's eviction is not seen: a miss then
costs what least-loaded would have. Only cores that are alive are chosen.
docs/08_server.md, "Data parallelism".
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from nanopaged.core.block_pool import HASH_FUNCTIONS, ROOT_HASH, hash_block

RULES = ("prefix-aware", "least-loaded", "round-robin")
OVERLOAD = 4               # past 2x the least loaded core's requests and this many more, a prefix hit is given up
PREFIX_MEMORY = 65_536     # block keys remembered, over all cores
PREFIX_BLOCKS = 64         # leading blocks of a request looked at (system prompts often share a long preamble)


@dataclass
class CoreLoad:
    """What the router knows of one engine core."""
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    sent: int = 0           # requests sent since its last figures (not in its counts yet)
    alive: bool = True

    def requests(self) -> int:
        return self.running + self.waiting + self.sent


class Router:
    def __init__(self, rule: str, num_cores: int, block_size: int, hash_name: str = "sha256") -> None:
        if rule not in RULES:
            raise ValueError(f"--dp-routing must be one of {', '.join(RULES)}, got {rule!r}")
        self.rule, self.block_size, self.hash_fn = rule, block_size, HASH_FUNCTIONS[hash_name]
        self.loads = [CoreLoad() for _ in range(num_cores)]
        self.holder: OrderedDict[bytes, set[int]] = OrderedDict()   # block key -> the cores sent it
        self.next = 0                                           # round-robin's turn

    # ---- what the cores say ---------------------------------------------------------------------
    def figures(self, core: int, running: int, waiting: int, kv_usage: float) -> None:
        self.loads[core] = CoreLoad(running, waiting, kv_usage, 0, self.loads[core].alive)

    def learn(self, core: int, keys: list[bytes]) -> None:
        """The core took requests with these prefix keys (from any API server: they come in its figures)."""
        for key in keys:
            self.holder.setdefault(key, set()).add(core)
            self.holder.move_to_end(key)
        while len(self.holder) > PREFIX_MEMORY:
            self.holder.popitem(last=False)

    def revived(self, core: int) -> None:
        """Another engine core took the dead one's place: empty, and chosen again."""
        self.loads[core] = CoreLoad()

    def died(self, core: int) -> None:
        self.loads[core].alive = False
        for key in [k for k, cores in self.holder.items() if core in cores]:
            self.holder[key].discard(core)
            if not self.holder[key]:
                del self.holder[key]

    # ---- one request ----------------------------------------------------------------------------
    def choose(self, keys: list[bytes]) -> int:
        """The core for a request with these prefix keys (`block_keys`); it is counted there at once.
        A ValueError if no core is alive."""
        alive = [i for i, load in enumerate(self.loads) if load.alive]
        if not alive:
            raise ValueError("no engine core is alive")
        core = self._rule(alive, keys)
        self.loads[core].sent += 1
        self.learn(core, keys)
        return core

    def _rule(self, alive: list[int], keys: list[bytes]) -> int:
        if self.rule == "round-robin":
            core = next((i for i in alive if i >= self.next), alive[0])
            self.next = core + 1
            return core
        least = min(alive, key=lambda i: (self.loads[i].requests(), self.loads[i].kv_usage, i))
        if self.rule == "least-loaded":
            return least
        depth = self.prefix_depths(keys)
        best = max(alive, key=lambda i: (depth.get(i, 0), -self.loads[i].requests(), -i))
        # a burst of requests arrives faster than the cores' figures: a queue twice as long is still worth a hit
        if depth.get(best, 0) - depth.get(least, 0) >= max(1, len(keys) / 2) and \
                self.loads[best].requests() <= 2 * self.loads[least].requests() + OVERLOAD:
            return best
        return least

    def prefix_depths(self, keys: list[bytes]) -> dict[int, int]:
        """Per core, how many of these leading keys it was sent. The keys are chained: a core that was sent
        key i was sent every key before it too."""
        depth = {}
        for i, key in enumerate(keys):
            for core in self.holder.get(key, ()):
                depth[core] = i + 1
        return depth

    def block_keys(self, tokens: list[int], salt, adapter: int) -> list[bytes]:
        """The chained keys of the request's first full blocks (at most PREFIX_BLOCKS)."""
        keys, parent, bs = [], ROOT_HASH, self.block_size
        for i in range(min(len(tokens) // bs, PREFIX_BLOCKS)):
            parent = hash_block(self.hash_fn, parent, tokens[i * bs:(i + 1) * bs], (salt, adapter) if i == 0 else ())
            keys.append(parent)
        return keys
