"""The fused kernels' RMSNorm keeps epsilon where the reference keeps it: inside the square root,
x * rsqrt(mean(x^2) + eps), with the eps it is given.

At a mean square of about 1 (the inputs of tests/cpu/test_cpu_ops.py) an eps of 1e-6 changes the
sixth digit: a kernel that dropped it, added it outside the root or used another one would pass
there. Here the rows' mean square is eps / 10, eps and 10 eps, where eps decides a third of the
value or more, and one row is zero, which eps alone keeps from 0 / 0. The kernels: rms_norm,
add_rms_norm, and the Qwen3 q/k norm inside rotary_and_store (its own eps, qk_eps); each against
nanopaged/models/llama.py: RMSNorm, on this CPU's build and on the AVX2-only one.
"""
import pytest
import torch

from nanopaged.cpu.build import available, from_kernel_layout
from nanopaged.models.llama import RMSNorm

pytestmark = pytest.mark.skipif(available() is not None, reason=f"{available()}")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPSILONS = [1e-5, 1e-6]
ROW_MEAN_SQUARES = [0.1, 1.0, 10.0, 0.0]         # times eps, one row each


def small_rows(dim: int, eps: float, seed: int) -> torch.Tensor:
    """(4, dim) float32 rows whose mean squares are about eps / 10, eps, 10 eps and exactly 0."""
    torch.manual_seed(seed)
    scale = (torch.tensor(ROW_MEAN_SQUARES) * eps).sqrt()
    return torch.randn(len(ROW_MEAN_SQUARES), dim) * scale[:, None]


def norm_with_weight(dim: int, eps: float, dtype: torch.dtype) -> RMSNorm:
    norm = RMSNorm(dim, eps).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim))
    return norm


def assert_close_to_reference(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32: within float32 rounding; bfloat16 / float16: equal but for a few values a unit or two
    of the dtype apart (a float32 sum in another order). NaN anywhere fails."""
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.isfinite(got).all(), "the kernel gave NaN or infinity"
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return
    exact = (got == want).float().mean().item()
    assert exact >= 0.98, f"only {exact:.1%} of the values equal the reference's"
    ulp = torch.finfo(got.dtype).eps * want.float().abs().clamp(min=1e-3)
    assert ((got.float() - want.float()).abs() <= 2 * ulp).all()


@pytest.mark.parametrize("dim", [576, 40, 7])
def test_these_inputs_are_where_epsilon_matters(dim):
    """The inputs below have the power to fail a kernel that mishandles eps: in every row the scale
    moves by more than 3% (four units of bfloat16) if eps is dropped, added outside the root, or
    swapped for the other one (at eps / 10, by 30% or more)."""
    for eps, other in zip(EPSILONS, reversed(EPSILONS)):
        x = small_rows(dim, eps, seed=dim)[:3]            # the zero row has no eps-free value
        ms = x.pow(2).mean(-1)
        right = torch.rsqrt(ms + eps)
        for wrong in (torch.rsqrt(ms), 1 / (ms.sqrt() + eps), torch.rsqrt(ms + other)):
            moved = (wrong / right - 1).abs()
            assert (moved > 0.03).all() and moved[0] > 0.3


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("eps", EPSILONS)
@pytest.mark.parametrize("dim", [576, 40, 7])        # 16 lanes at a time, lanes and a tail, a tail only
def test_rms_norm_keeps_epsilon_inside_the_root(ops, dtype, eps, dim):
    norm = norm_with_weight(dim, eps, dtype)
    x = small_rows(dim, eps, seed=dim).to(dtype)
    with torch.no_grad():
        want = norm(x)
        assert_close_to_reference(ops.rms_norm(x, norm.weight.detach(), eps), want)
    assert (want[-1] == 0).all()                          # a zero row stays zero, not 0 / 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("eps", EPSILONS)
@pytest.mark.parametrize("dim", [576, 40])
def test_add_rms_norm_keeps_epsilon_inside_the_root(ops, dtype, eps, dim):
    """The residual x + y is small (two halves of a small row), then normed with eps."""
    norm = norm_with_weight(dim, eps, dtype)
    rows = small_rows(dim, eps, seed=dim + 1)
    x, y = (rows / 2).to(dtype), (rows / 2).to(dtype)
    want_x = x + y
    with torch.no_grad():
        want = norm(want_x)
        got = ops.add_rms_norm(x, y, norm.weight.detach(), eps)
    assert torch.equal(x, want_x)                         # the residual, added in place
    assert_close_to_reference(got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("eps", EPSILONS)
@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 2, 128), (2, 1, 40)])
def test_the_qk_norm_in_rotary_and_store_keeps_its_epsilon_inside_the_root(ops, dtype, eps, heads, kv_heads, dim):
    """Qwen3 norms each q and k head with its own eps before rotating it. The rotation here is the
    identity (cos 1, sin 0), so q (in place) and k (in the cache) are each head's norm."""
    n, block, num_blocks = len(ROW_MEAN_SQUARES), 4, 8
    q_norm, k_norm = norm_with_weight(dim, eps, dtype), norm_with_weight(dim, eps, dtype)
    # every head of token t has the mean square of small_rows' row t
    qkv = torch.cat([small_rows(dim, eps, seed=dim + h) for h in range(heads + 2 * kv_heads)], dim=1).to(dtype)
    q, k, v = qkv.clone().split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    cos, sin = torch.ones(n, dim, dtype=dtype), torch.zeros(n, dim, dtype=dtype)
    k_cache, v_cache = torch.zeros(2, num_blocks, block, kv_heads, dim, dtype=dtype)
    slots = torch.tensor([5, 0, 11, 3])
    ops.rotary_and_store(qkv, cos, sin, q_norm.weight.detach(), k_norm.weight.detach(), eps, heads, kv_heads,
                         k_cache, v_cache, slots)
    with torch.no_grad():
        want_q = q_norm(q.reshape(n, heads, dim))
        want_k = k_norm(k.reshape(n, kv_heads, dim))
    assert_close_to_reference(qkv[:, :heads * dim].reshape(n, heads, dim), want_q)
    k_got, _ = from_kernel_layout(k_cache, v_cache)
    assert_close_to_reference(k_got.flatten(0, 1)[slots], want_k)
