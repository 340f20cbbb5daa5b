"""The rejection rule (vLLM: v1/sample/rejection_sampler.py, and its tests' cases): greedy output is
plain decoding's; sampled output is distributed as the target's p whatever the drafts' q."""
import pytest
import torch
from conftest import chi2_critical

from nanopaged.sample.rejection_sampler import accept_greedy, accept_sampled, runs
from nanopaged.spec_decode.stats import SpecDecodeStats


def fits(observed: torch.Tensor, p: torch.Tensor) -> bool:
    """Pearson's chi-square test of `observed` counts against the distribution p, at p = 0.001."""
    expected = p * observed.sum()
    keep = expected > 0
    stat = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    return stat < chi2_critical(int(keep.sum()) - 1) and not observed[~keep].any()


@pytest.mark.parametrize("argmax, drafts, out", [
    ([1, 2, 3, 4], [1, 2, 3], [1, 2, 3, 4]),     # perfect match: every draft and the bonus token
    ([1, 5, 3, 4], [1, 2, 3], [1, 5]),           # early mismatch: the target's token, nothing after
    ([7, 2, 3, 4], [1, 2, 3], [7]),              # the first draft is wrong
    ([1, 2, 9, 4], [1, 2, 3], [1, 2, 9]),
    ([6], [], [6]),                              # no drafts: one plain token
])
def test_accept_greedy(argmax, drafts, out):
    assert accept_greedy(argmax, drafts) == out


def test_runs_groups_a_requests_rows():
    a, b, c = object(), object(), object()
    assert runs([a, a, a, b, c, c]) == [(a, 0, 3), (b, 3, 1), (c, 4, 2)]


P = torch.tensor([[0.30, 0.25, 0.20, 0.10, 0.10, 0.05],
                  [0.05, 0.10, 0.40, 0.25, 0.15, 0.05],
                  [0.50, 0.10, 0.10, 0.10, 0.10, 0.10]])
Q = torch.tensor([[0.05, 0.05, 0.10, 0.60, 0.10, 0.10],      # the draft favours token 3, p does not
                  [0.30, 0.30, 0.10, 0.10, 0.10, 0.10]])
TRIALS = 20000
# A 5% shift (0.05 of probability moved from a token of p 0.30 to one of p 0.10) gives chi-square
# about TRIALS * (0.05^2 / 0.30 + 0.05^2 / 0.10) = 667 against a critical value of ~21 (5 dof,
# p = 0.001): the tests below would see it.


def emitted(p, q, rule=accept_sampled, seed=0):
    """The first and the second token emitted, over TRIALS verify steps of 2 drafts drawn from q (or
    fixed drafts for q=None, as the n-gram proposer's are)."""
    g = torch.Generator().manual_seed(seed)
    draw = lambda probs: int(torch.multinomial(probs, 1, generator=g))  # noqa: E731
    first, second = torch.zeros(6), torch.zeros(6)
    for _ in range(TRIALS):
        drafts = [3, 2] if q is None else [draw(q[0]), draw(q[1])]
        out = rule(p, drafts, q, g, draw)
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    return first, second


@pytest.mark.parametrize("q", [None, Q], ids=["ngram", "draft"])
def test_accept_sampled_leaves_the_distribution_unchanged(q):
    first, second = emitted(P, q)
    assert fits(first, P[0])
    # the second token, given that the first draft was accepted, follows row 1 of p
    assert fits(second, P[1])


def test_a_wrong_rule_is_caught():
    """The test above has the power to fail: accepting every draft gives q's distribution, not p's."""
    def accept_all(p, drafts, q, g, draw):
        return drafts + [draw(p[len(drafts)])]
    first, _ = emitted(P, Q, accept_all)
    assert not fits(first, P[0])


def test_p_equal_to_q_accepts_everything():
    g = torch.Generator().manual_seed(1)
    draw = lambda probs: int(torch.multinomial(probs, 1, generator=g))  # noqa: E731
    for _ in range(200):
        drafts = [draw(P[0]), draw(P[1])]
        assert accept_sampled(P, drafts, P[:2], g, draw)[:2] == drafts


def test_a_draft_the_target_rules_out_is_always_rejected():
    p = torch.tensor([[0.0, 0.5, 0.5], [0.2, 0.4, 0.4]])
    g = torch.Generator().manual_seed(2)
    draw = lambda probs: int(torch.multinomial(probs, 1, generator=g))  # noqa: E731
    for _ in range(200):
        out = accept_sampled(p, [0], None, g, draw)
        assert len(out) == 1 and out[0] in (1, 2)


def test_chi2_critical():
    assert chi2_critical(5) == pytest.approx(20.52, rel=0.02)     # the table's value
    assert chi2_critical(20) == pytest.approx(45.31, rel=0.02)


def test_the_same_generator_gives_the_same_tokens():
    a, b = emitted(P, Q, seed=5), emitted(P, Q, seed=5)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_stats_count_as_vllm_does():
    s = SpecDecodeStats(3)
    s.record(3, 2)
    s.record(3, 0)
    s.record(0, 0)                  # no drafts: not a draft
    s.record(2, 2)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, s.accepted_per_pos) == (3, 8, 4, [2, 2, 0])
    assert s.mean_acceptance_length == pytest.approx(1 + 4 / 3)
    base = s.copy()
    s.record(3, 3)
    assert s.since(base).as_dict()["accepted_per_pos"] == [1, 1, 1]


# The bonus token: with every draft kept, one more token comes from the last row, p[k] (k = 2 here).
# Drafts the target likes (kept 56% of the time for the n-gram's [0, 1], 72% for the draft model's),
# so about 11,000 of the trials end in a bonus; the last row differs from the row before it and from
# either residual max(p[2] - q[1], 0) (n-gram: p[2] without token 1).
P_BONUS = torch.tensor([[0.80, 0.05, 0.05, 0.05, 0.03, 0.02],   # row 0: scores d_1
                        [0.05, 0.70, 0.10, 0.05, 0.05, 0.05],   # row 1: scores d_2
                        [0.05, 0.40, 0.10, 0.05, 0.30, 0.10]])  # row 2: the bonus row
Q_BONUS = torch.tensor([[0.60, 0.10, 0.10, 0.10, 0.05, 0.05],
                        [0.10, 0.60, 0.10, 0.10, 0.05, 0.05]])


def bonus_tokens(q, rule=accept_sampled, seed=3, trials=TRIALS):
    """The third token emitted, counted over `trials` verify steps of 2 drafts (n-gram's [0, 1] for
    q=None, else drawn from q), and how many steps kept both drafts."""
    g = torch.Generator().manual_seed(seed)
    draw = lambda probs: int(torch.multinomial(probs, 1, generator=g))  # noqa: E731
    bonus, kept_all = torch.zeros(6), 0
    for _ in range(trials):
        drafts = [0, 1] if q is None else [draw(q[0]), draw(q[1])]
        out = rule(P_BONUS, drafts, q, g, draw)
        if len(out) == 3:
            assert out[:2] == drafts
            bonus[out[2]] += 1
            kept_all += 1
    return bonus, kept_all


@pytest.mark.parametrize("q", [None, Q_BONUS], ids=["ngram", "draft"])
def test_the_bonus_token_after_every_kept_draft_is_drawn_from_the_last_row(q):
    bonus, kept_all = bonus_tokens(q)
    # both drafts kept with probability sum min(p_0, q_0) * sum min(p_1, q_1) (q one-hot: p_0(0) p_1(1))
    rows = torch.eye(6)[[0, 1]] if q is None else q
    chance = float(torch.minimum(P_BONUS[:2], rows).sum(-1).prod())
    assert abs(kept_all - TRIALS * chance) < 4 * (TRIALS * chance * (1 - chance)) ** 0.5
    assert fits(bonus, P_BONUS[2])


def test_a_bonus_from_another_row_or_a_residual_is_caught():
    """The test above has the power to fail: a bonus drawn from row k - 1, or from the residual
    max(p[k] - q[k - 1], 0) as if the last draft had been rejected, does not fit row k."""
    def bonus_from_the_row_before(p, drafts, q, g, draw):
        out = accept_sampled(p, drafts, q, g, draw)
        return out[:-1] + [draw(p[len(drafts) - 1])] if len(out) == len(drafts) + 1 else out

    def bonus_from_a_residual(p, drafts, q, g, draw):
        out = accept_sampled(p, drafts, q, g, draw)
        if len(out) < len(drafts) + 1:
            return out
        last_q = torch.eye(p.shape[1])[drafts[-1]] if q is None else q[-1]
        return out[:-1] + [draw((p[-1] - last_q).clamp(min=0.0))]

    for q in (None, Q_BONUS):
        for wrong in (bonus_from_the_row_before, bonus_from_a_residual):
            bonus, _ = bonus_tokens(q, wrong, trials=TRIALS // 5)
            assert not fits(bonus, P_BONUS[2]), (wrong.__name__, q)
