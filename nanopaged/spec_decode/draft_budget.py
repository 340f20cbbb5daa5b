"""The draft budget: how many draft tokens each request gets next step, for every method.

Alone, a verify step of 1 + k tokens costs about what a step of 1 does (the weights are read once
either way); in a batch of 16 every draft token is a row of work more. Two things decide a step's
drafts, both learned as the engine runs:

    the step's cost       seconds per step ~ c0 + c1 * tokens, fitted to the steps the engine ran
                          (StepRecord.times, exponentially weighted least squares)
    each request's rate   a: how often its method's drafts are accepted, an exponential moving
                          average with a prior; the i-th draft token is expected to add a^i tokens

A step that computes T tokens and expects to emit E earns E / cost(T) tokens a second. One draft
token more adds a^i expected tokens for c1 seconds; it pays while a^i / c1 > E / cost(T). So the rule
hands out draft tokens one at a time, the most promising first (the highest a^i in the batch), while
each pays, at most k a request and never past what it may still emit. A request whose drafts keep
failing (a below MIN_ACCEPTANCE) gets none, but one probe draft every PROBE_EVERY steps lets it
recover. Drafts the grammar forces (structured outputs: drafter.py) are not cut: they are accepted
almost always, so they count as a = 1.

One exception keeps batch invariance: a sampled request with a seed draws its uniforms and tokens
from its own generator, one draw per draft verified, so its sample depends on its drafts. Its
drafts are therefore decided by its own record alone (all k while its rate holds, else the probe),
never by the step's cost, which depends on the batch. Greedy requests need no exception: their
tokens are the argmax whatever is drafted. docs/11_speculative_decoding.md, "What a draft costs in a batch".
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from nanopaged.core.request import Request

PRIOR_ACCEPTANCE = 0.6     # a request's rate before its first verify step
PRIOR_WEIGHT = 2.0         # ... worth this many drafts seen
DECAY = 0.8                # a verify step's weight in the average falls by this much a step
MIN_ACCEPTANCE = 0.3       # below it a request's method drafts nothing ...
PROBE_EVERY = 8            # ... but one token every this many steps
COST_DECAY = 0.98          # the cost model forgets a step this fast
MAX_KEPT = 256             # acceptance records kept for get_stats (running requests, then the latest)


def room(request: Request, k: int) -> int:
    """How many drafts a request can take next step: 0 unless it decodes next (its K/V is computed up
    to its last token); never more than k, nor than the tokens it may still emit less the one the
    step adds anyway (max_tokens, clipped to max_model_len)."""
    if request.num_computed_tokens != request.num_tokens - 1:
        return 0
    return max(0, min(k, request.max_tokens - request.num_output_tokens - 1))


def seeded(request: Request) -> bool:
    """A sampled request with its own generator: its drafts must not depend on its batch."""
    params = request.sampling_params
    return params.seed is not None and not params.greedy


@dataclass
class Acceptance:
    """One request's record: its method's drafts accepted and tried, each step's count decayed."""
    accepted: float = 0.0
    tried: float = 0.0
    steps_without: int = 0          # steps since it last drafted

    @property
    def rate(self) -> float:
        return (self.accepted + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (self.tried + PRIOR_WEIGHT)

    def add(self, drafts: int, accepted: int) -> None:
        """A verify step: `accepted` drafts in a row passed, then one failed unless all did."""
        self.accepted = DECAY * self.accepted + accepted
        self.tried = DECAY * self.tried + accepted + (accepted < drafts)


class StepCost:
    """Seconds per step ~ c0 + c1 * tokens: a line through the recent steps (weighted least squares)."""

    def __init__(self) -> None:
        self.w = self.t = self.y = self.tt = self.ty = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        d = COST_DECAY
        self.w, self.t, self.y = d * self.w + 1, d * self.t + tokens, d * self.y + seconds
        self.tt, self.ty = d * self.tt + tokens * tokens, d * self.ty + tokens * seconds

    def line(self) -> tuple[float, float]:
        """(c0, c1); c1 = 0 until the steps seen differ in size (no slope to read yet: drafts look free)."""
        if self.w == 0:
            return 0.0, 0.0
        mean_t, mean_y = self.t / self.w, self.y / self.w
        var = self.tt / self.w - mean_t * mean_t
        slope = max(0.0, (self.ty / self.w - mean_t * mean_y) / var) if var > 1e-9 else 0.0
        return max(mean_y - slope * mean_t, 0.0), slope

    def __call__(self, tokens: int) -> float:
        c0, c1 = self.line()
        return c0 + c1 * tokens


class DraftBudget:
    """The engine's one budget (drafter.py asks it); an observer of the steps (StepRecord) learns."""

    def __init__(self, stats=None) -> None:
        self.stats = stats                           # SpecDecodeStats: forced drafts accepted
        self.cost = StepCost()
        self.acceptance: OrderedDict[Request, Acceptance] = OrderedDict()
        self.drafted: dict[Request, int] = {}       # forced drafts of each request's pending step

    def record(self, request: Request) -> Acceptance:
        rec = self.acceptance.get(request)
        if rec is None:
            rec = self.acceptance[request] = Acceptance()
            while len(self.acceptance) > MAX_KEPT:
                self.acceptance.popitem(last=False)
        return rec

    def plan(self, wanted: list[tuple[Request, int, int]], num_plain_tokens: int) -> list[int]:
        """wanted: (request, forced drafts, most method drafts it may take); the method drafts each
        gets. `num_plain_tokens`: what the step computes without method drafts (rows and forced drafts)."""
        c0, c1 = self.cost.line()
        tokens = num_plain_tokens
        expected = float(sum(1 + forced for _, forced, _ in wanted))   # a forced draft counts as a = 1
        gets = [0] * len(wanted)
        rates = [self.record(r).rate for r, _, _ in wanted]
        own = [seeded(r) for r, _, _ in wanted]
        for i, (r, _, most) in enumerate(wanted):
            rec = self.record(r)
            if most and rates[i] < MIN_ACCEPTANCE and rec.steps_without + 1 >= PROBE_EVERY:
                gets[i] = 1                      # the probe: a chance to show its drafts work again
            elif own[i] and rates[i] >= MIN_ACCEPTANCE:
                gets[i] = most                   # its own record decides, not the batch
            tokens += gets[i]
            expected += sum(rates[i] ** j for j in range(1, gets[i] + 1))
        while True:
            best, gain = None, 0.0
            for i, (_, _, most) in enumerate(wanted):
                if own[i]:
                    continue
                if gets[i] < most and rates[i] >= MIN_ACCEPTANCE and rates[i] ** (gets[i] + 1) > gain:
                    best, gain = i, rates[i] ** (gets[i] + 1)
            # pays: gain / c1 > expected / cost, written without dividing by a c1 of 0
            if best is None or gain * (c0 + c1 * tokens) <= c1 * expected:
                break
            gets[best] += 1
            tokens, expected = tokens + 1, expected + gain
        for (r, _, most), n in zip(wanted, gets):
            rec = self.acceptance[r]
            rec.steps_without = 0 if n else rec.steps_without + 1
        return gets

    def __call__(self, step) -> None:
        """A step observer: its seconds against its tokens, and each drafted request's outcome."""
        out = step.scheduler_output
        t0, t1, t2, t3 = step.times
        self.cost.add(sum(n for _, n in out.scheduled), t2 - t1)
        for request, n in out.scheduled:
            forced = self.drafted.pop(request, None)
            tokens = step.sampled.get(request)
            if forced is None or not tokens or n < 2:
                continue
            drafts, accepted = n - 1, len(tokens) - 1
            if self.stats is not None:
                self.stats.num_accepted_forced_tokens += min(forced, drafts, accepted)
            method = drafts - min(forced, drafts)
            if method and accepted >= forced:    # the method's drafts were reached and tried
                self.record(request).add(method, accepted - forced)
        for request, _ in step.stopped:
            self.drafted.pop(request, None)

    def rates(self) -> dict[str, float]:
        """request id -> acceptance rate, of the requests followed (get_stats()['spec_decode'])."""
        return {r.request_id: rec.rate for r, rec in self.acceptance.items()}
