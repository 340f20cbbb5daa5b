"""The draft budget (spec_decode/draft_budget.py) on its own: plain Python, no model. A request
whose drafts fail gets none, and recovers after a probe; the budget shrinks as the measured step
cost grows with the tokens a step computes; forced drafts are never cut; the most a request may
take (max_tokens) still bounds it."""
from types import SimpleNamespace

from nanopaged import SamplingParams
from nanopaged.core.request import Request
from nanopaged.spec_decode.draft_budget import PRIOR_ACCEPTANCE, PROBE_EVERY, DraftBudget, StepCost, room
from nanopaged.spec_decode.stats import SpecDecodeStats


def decoding(i=0, max_tokens=64):
    r = Request(str(i), [1, 2, 3], SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens)
    r.output_token_ids = [4]
    r.num_computed_tokens = r.num_tokens - 1
    return r


def costed(c0, c1):
    """A budget whose step cost model has seen steps costing c0 + c1 * tokens."""
    b = DraftBudget()
    for tokens in (1, 4, 16, 64):
        b.cost.add(tokens, c0 + c1 * tokens)
    return b


def test_the_cost_model_reads_the_line_through_the_steps():
    cost = StepCost()
    for tokens in (1, 2, 8, 32):
        cost.add(tokens, 0.010 + 0.002 * tokens)
    c0, c1 = cost.line()
    assert abs(c0 - 0.010) < 1e-9 and abs(c1 - 0.002) < 1e-9


def test_a_free_verify_step_drafts_up_to_k():
    """Cost flat in the tokens (one request on a CPU reads the weights once either way): all k."""
    b = costed(0.02, 0.0)
    assert b.plan([(decoding(), 0, 5)], 1) == [5]


def test_the_budget_shrinks_as_the_step_cost_grows_with_the_batch():
    batch = [decoding(i) for i in range(16)]
    cheap = sum(costed(0.02, 0.00005).plan([(r, 0, 5) for r in batch], 16))
    dear = sum(costed(0.02, 0.0005).plan([(r, 0, 5) for r in batch], 16))
    dearer = sum(costed(0.02, 0.002).plan([(r, 0, 5) for r in batch], 16))
    assert cheap == 80 and cheap > dear > dearer == 0


def test_rejected_drafts_get_none_and_a_probe_lets_a_request_recover():
    b, r = costed(0.02, 0.0), decoding()
    for _ in range(10):
        b.record(r).add(4, 0)                 # every draft rejected
    plans = [b.plan([(r, 0, 4)], 1)[0] for _ in range(PROBE_EVERY)]
    assert plans[:-1] == [0] * (PROBE_EVERY - 1) and plans[-1] == 1     # the probe
    for _ in range(4):
        b.record(r).add(4, 4)                 # ... its drafts work again
    assert b.plan([(r, 0, 4)], 1) == [4]


def test_the_better_request_gets_the_tokens_first():
    b = costed(0.02, 0.001)
    good, poor = decoding(0), decoding(1)
    for _ in range(5):
        b.record(good).add(4, 4)
        b.record(poor).add(4, 1)
    g, p = b.plan([(good, 0, 4), (poor, 0, 4)], 2)
    assert g >= p and g > 0


def test_forced_drafts_are_not_cut():
    """The plan gives method drafts; forced ones (the grammar's) are the caller's, whatever it costs."""
    b, r = costed(0.02, 0.02), decoding()
    for _ in range(10):
        b.record(r).add(4, 0)
    assert b.plan([(r, 3, 0)], 4) == [0]      # nothing more than its 3 forced drafts, which it keeps


def test_room_is_what_max_tokens_and_the_step_allow():
    assert room(decoding(max_tokens=3), 5) == 1           # 1 output, the step's own token, 1 draft
    r = decoding()
    r.num_computed_tokens = 1                             # in its prompt: no drafts
    assert room(r, 5) == 0


def test_a_seeded_sampled_request_drafts_the_same_in_any_batch():
    """Its generator draws once per draft verified: its drafts follow its own record, never the step's
    cost, so its sample is the same alone and in a batch of 16 (batch invariance)."""
    def seeded(i):
        r = decoding(i)
        r.sampling_params = SamplingParams(temperature=1.0, seed=7, max_tokens=64)
        return r
    dear = costed(0.02, 0.002)                # a cost at which an unseeded request gets nothing
    batch = [seeded(i) for i in range(16)]
    assert dear.plan([(r, 0, 5) for r in batch], 16) == [5] * 16
    assert costed(0.02, 0.0).plan([(seeded(99), 0, 5)], 1) == [5]
    assert dear.plan([(decoding(50), 0, 5)] * 16, 16) == [0] * 16


def verified(budget, request, forced, drafts, accepted):
    """The budget observes one verify step: `drafts` drafts (the first `forced` of them the grammar's)
    scheduled after the request's own token, of which the first `accepted` passed."""
    budget.drafted[request] = forced
    tokens = [9] * (accepted + 1)                # the accepted drafts and the step's own token
    step = SimpleNamespace(scheduler_output=SimpleNamespace(scheduled=[(request, 1 + drafts)]),
                           sampled={request: tokens}, stopped=[], times=(0.0, 0.0, 0.01, 0.01))
    budget(step)


def test_a_step_where_every_draft_passed_records_each_as_accepted_and_none_as_failed():
    """Acceptance counts the drafts that passed and the one that failed: when all passed, none failed,
    so the rate rises above the prior and the record holds accepted == tried (no phantom failure)."""
    b, r = DraftBudget(SpecDecodeStats(5)), decoding()
    verified(b, r, forced=0, drafts=4, accepted=4)
    rec = b.record(r)
    assert (rec.accepted, rec.tried) == (4, 4) and rec.rate > PRIOR_ACCEPTANCE
    verified(b, r, forced=2, drafts=5, accepted=5)         # the method's 3 after 2 forced: all passed
    assert rec.tried == rec.accepted == 0.8 * 4 + 3
    assert b.stats.num_accepted_forced_tokens == 2
    verified(b, r, forced=0, drafts=4, accepted=2)         # two passed, the third failed: one failure
    assert rec.tried - rec.accepted == 1
