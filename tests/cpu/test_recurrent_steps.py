"""A hybrid's decode token in C++ (csrc/recurrent.cpp through cpu/recurrent.py) against the torch references
it replaces (models/gated_delta_rule.py: paged_recurrent_step, models/mamba2.py: paged_ssd_step): the same
outputs and states within float32 rounding, on strided state pages as the runner lays them out; pages not in
the step untouched; a fresh row started from zero whatever its page holds; each row's bits its own at any
batch. On this CPU's build and on a build without AVX-512 (the `ops` fixture)."""
import pytest
import torch

from nanopaged.cpu.build import available
from nanopaged.models import gated_delta_rule as rule
from nanopaged.models import mamba2

pytestmark = pytest.mark.skipif(available() is not None, reason=f"{available()}")
PAGES = 9


def strided_pages(*shape, extra=7):
    """(PAGES, *shape) float32 states inside a wider buffer: each page followed by `extra` unused values,
    as a hybrid's pages hold a state beside the rest of a K/V block."""
    size = 1
    for n in shape:
        size *= n
    buffer = torch.randn(PAGES, size + extra)
    return buffer[:, :size].view(PAGES, *shape), buffer


def delta_inputs(R, H=3, dk=16, dv=8, seed=0):
    torch.manual_seed(seed)
    return (torch.randn(R, H, dk), torch.randn(R, H, dk), torch.randn(R, H, dv), -torch.rand(R, H),
            torch.rand(R, H))


def ssd_inputs(R, H=4, P=8, N=16, seed=0):
    torch.manual_seed(seed)
    return (torch.randn(R, H, P), 0.5 * torch.rand(R, H), -torch.rand(H) - 0.1, torch.randn(R, H, N),
            torch.randn(R, H, N), torch.randn(H))


def conv_inputs(R, C=12, K=4, bias=True, seed=0):
    torch.manual_seed(seed)
    return torch.randn(R, C), torch.randn(C, K), (torch.randn(C) if bias else None)


CASES = {
    "gated_delta": (lambda ops: ops.gated_delta_step, rule.paged_recurrent_step, delta_inputs, (3, 16, 8)),
    "ssd": (lambda ops: ops.ssd_step, mamba2.paged_ssd_step, ssd_inputs, (4, 8, 16)),
    # the short convolution: Qwen3.5's (no bias) and Mamba-2's (a bias); pages (C, K - 1) here, hence a
    # leading 1 the tests index away
    "conv_qwen3_5": (lambda ops: ops.conv_step, rule.paged_conv_step, lambda R, seed=0: conv_inputs(R, bias=False,
                                                                                                   seed=seed), (12, 3)),
    "conv_mamba2": (lambda ops: ops.conv_step, mamba2.paged_conv_step, conv_inputs, (12, 3)),
}


def kernel(ops, name):
    """The C++ kernel behind cpu/recurrent.py's wrapper, on `ops` (this CPU's build or the AVX2 one), with
    the wrapper's preparation of the inputs."""
    from nanopaged.cpu import recurrent
    raw = CASES[name][0](ops)
    if name.startswith("conv"):
        return lambda x, weight, bias, *paged: raw(x, weight, bias if bias is not None else torch.empty(0), *paged)
    if name == "gated_delta":
        return lambda q, k, v, g, beta, *paged: raw(*(x.contiguous() for x in rule.prepare(q, k, v, g, beta)),
                                                    *paged)
    return lambda *args: raw(*(t.contiguous() for t in args[:6]), *args[6:])


@pytest.mark.parametrize("name", list(CASES))
def test_the_kernel_equals_the_reference_on_strided_pages(ops, name):
    _, reference, inputs, shape = CASES[name]
    args = inputs(5)
    index = torch.tensor([4, 0, 7, 2, 5])
    fresh = torch.tensor([False, True, False, False, True])
    pages, buffer = strided_pages(*shape)
    want_pages, want_buffer = pages.clone(), buffer.clone()
    want = reference(*args, want_pages, index, fresh)
    got = kernel(ops, name)(*args, pages, index, fresh)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pages, want_pages, rtol=1e-5, atol=1e-5)
    untouched = [p for p in range(PAGES) if p not in index.tolist()]
    assert torch.equal(buffer[untouched], want_buffer[untouched])          # other pages, bit for bit
    assert torch.equal(buffer[:, -7:], want_buffer[:, -7:])               # and what lies beside each state


@pytest.mark.parametrize("name", list(CASES))
def test_a_fresh_row_starts_from_zero_whatever_its_page_holds(ops, name):
    _, _, inputs, shape = CASES[name]
    args = inputs(1)
    run = kernel(ops, name)
    a, _ = strided_pages(*shape)
    b = torch.zeros_like(a)
    out_a = run(*args, a, torch.tensor([3]), torch.tensor([True]))
    out_b = run(*args, b, torch.tensor([3]), torch.tensor([False]))
    assert torch.equal(out_a, out_b) and torch.equal(a[3], b[3])


@pytest.mark.parametrize("name", list(CASES))
def test_each_rows_bits_are_its_own_at_any_batch(ops, name):
    """Row r of a step of 7 equals row r computed alone, bit for bit, state and output."""
    _, _, inputs, shape = CASES[name]
    args = inputs(7, seed=3)
    run = kernel(ops, name)
    pages, _ = strided_pages(*shape)
    start = pages.clone()
    together = run(*args, pages, torch.arange(7), torch.zeros(7, dtype=torch.bool))
    for r in range(7):
        alone_pages = start.clone()
        row = [a[r:r + 1] if a is not None and a.shape[0] == 7 else a for a in args]
        alone = run(*row, alone_pages, torch.tensor([r]), torch.tensor([False]))
        assert torch.equal(alone[0], together[r]) and torch.equal(alone_pages[r], pages[r])
