"""The encoder cache: which images' encoder outputs the runner holds, and how much encoding a step may do.

An image is the second thing besides K/V that a request holds (the seed article: preemption frees "all
blocks and the encoder cache"). Its encoder output is computed once, in the step that first schedules a
token of its placeholder span, and read from the cache by every later chunk that cuts through the span.
The scheduler asks this class two questions per request (vLLM: v1/core/encoder_cache_manager.py and the
scheduler's `_try_schedule_encoder_inputs`):

    fit    how many of the tokens it wants this step may run, given that every image whose span they
           touch must be in the cache or encoded now, within the step's encoder budget and the cache's room
    take   commit that: the images to encode go into the step's output, the others are hits

Entries are counted in encoder rows (`num_embeds`), keyed by the image's content hash, so two requests
with the same image share one entry. A request stops using an entry when its computed tokens pass the
span, or when it is preempted or finishes; an entry no request uses is kept, oldest first given up when
room is needed (a later request with the same image still hits). The runner drops the tensors of the
entries given up (`SchedulerOutput.encoder_frees`). No torch: the tensors live with the runner.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nanopaged.core.request import Request


@dataclass(eq=False)
class EncoderInput:
    """One image of a prompt, as the scheduler sees it."""
    hash: str                # its content (and its processing): the cache key and the block hash's extra key
    offset: int              # the prompt position of its placeholder span's first token
    length: int              # the span's tokens
    num_embeds: int          # rows the encoder gives: what it costs in the budget and the cache
    data: object = None      # what the encoder reads; the scheduler never looks

    def overlaps(self, start: int, end: int) -> bool:
        """Does its span share a position with [start, end)?"""
        return self.offset < end and self.offset + self.length > start


class EncoderCache:
    def __init__(self, cache_size: int, step_budget: int) -> None:
        self.cache_size, self.step_budget = cache_size, step_budget
        self.entries: dict[str, int] = {}          # hash -> num_embeds, held by the runner
        self.users: dict[str, set[int]] = {}       # hash -> ids of the requests reading it
        self.unused: OrderedDict[str, int] = OrderedDict()   # entries no request reads, oldest first
        self.budget_left = step_budget
        self.num_hits = self.num_encoded = 0

    @property
    def num_free(self) -> int:
        return self.cache_size - sum(self.entries.values())

    def new_step(self) -> None:
        self.budget_left = self.step_budget

    # ---- scheduling ------------------------------------------------------------------------------
    def fit(self, request: Request, num_new: int) -> tuple[int, list[int]]:
        """(tokens that may run, indexes of the images to encode for them); no change is made. A span the
        step cannot encode for cuts the step before it, so chunked prefill stops at the image."""
        start, budget, to_encode = request.num_computed_tokens, self.budget_left, []
        touched = touching(request, num_new)
        hits = {image.hash for _, image in touched if image.hash in self.entries}
        room = self.num_free + sum(size for key, size in self.unused.items() if key not in hits)
        for i, image in touched:
            if image.hash in hits or any(request.encoder_inputs[j].hash == image.hash for j in to_encode):
                continue                           # in the cache, or the same image earlier in this prompt
            if image.num_embeds > min(budget, room):
                return max(image.offset - start, 0), to_encode
            budget, room = budget - image.num_embeds, room - image.num_embeds
            to_encode.append(i)
        return num_new, to_encode

    def take(self, request: Request, num_new: int, to_encode: list[int], out) -> None:
        """The step runs num_new tokens of the request: it reads every image they touch (hits first, so
        that making room never gives them up), and its images to encode enter the cache."""
        for i, image in touching(request, num_new):
            if i not in to_encode and image.hash in self.entries:
                self.num_hits += id(request) not in self.users.get(image.hash, ())
                self._use(image.hash, request)
        for i in to_encode:
            image = request.encoder_inputs[i]
            self._make_room(image.num_embeds, out.encoder_frees)
            self.entries[image.hash] = image.num_embeds
            self.budget_left -= image.num_embeds
            self.num_encoded += 1
            self._use(image.hash, request)
            out.encoder_inputs.append((request, i))

    # ---- letting go -----------------------------------------------------------------------------
    def done_with(self, request: Request) -> None:
        """After a step: the request no longer reads the images whose spans it has computed."""
        for image in request.encoder_inputs:
            if image.offset + image.length <= request.num_computed_tokens:
                self._drop_user(image.hash, request)

    def release(self, request: Request) -> None:
        """The request was preempted or finished: it reads none of its images any more."""
        for image in request.encoder_inputs:
            self._drop_user(image.hash, request)

    def _use(self, key: str, request: Request) -> None:
        self.users.setdefault(key, set()).add(id(request))
        self.unused.pop(key, None)

    def _drop_user(self, key: str, request: Request) -> None:
        users = self.users.get(key)
        if users is None or id(request) not in users:
            return
        users.discard(id(request))
        if not users:
            del self.users[key]
            self.unused[key] = self.entries[key]

    def _make_room(self, size: int, frees: list[str]) -> None:
        while self.num_free < size:
            key, _ = self.unused.popitem(last=False)
            del self.entries[key]
            frees.append(key)


def touching(request: Request, num_new: int) -> list[tuple[int, EncoderInput]]:
    """(index, image) of each image whose span the request's next num_new tokens reach."""
    start = request.num_computed_tokens
    return [(i, image) for i, image in enumerate(request.encoder_inputs) if image.overlaps(start, start + num_new)]
