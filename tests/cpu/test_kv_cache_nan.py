"""An int8 KV cache keeps a NaN as the torch reference keeps it (attention/torch_backend.py:
to_cache_dtype): a row holding a NaN gets scale NaN and codes 0, so every value read back from it
is NaN, in the C++ store (cpu/csrc/kv_layout.h: row_scale, to_cache) as in the reference, byte for
byte; an infinity likewise (scale infinity; its own code, inf / inf, is 0 in both).
"""
import pytest
import torch

from nanopaged.attention.torch_backend import from_cache_dtype, store_kvcache
from nanopaged.cpu.build import available, to_kernel_layout

pytestmark = pytest.mark.skipif(available() is not None, reason=f"{available()}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_nan_in_an_int8_row_is_stored_as_the_reference_stores_it(ops, dtype):
    torch.manual_seed(4)
    n, kv_heads, dim = 40, 2, 64
    k = torch.randn(n, kv_heads, dim).to(dtype)
    k[3, 0, 5] = float("nan")                    # first, middle and last place of a row; a row of NaNs
    k[4, 1, 0] = float("nan")
    k[5, 0, dim - 1] = float("nan")
    k[6, 1] = float("nan")
    k[9, 0, 7] = float("inf")
    k[10, 1, 2] = float("-inf")
    v = k.roll(2, 0)
    slots = torch.randperm(8 * 16)[:n]
    want = torch.zeros(2, 8, 16, kv_heads, dim + 4, dtype=torch.int8)
    store_kvcache(k, v, want[0], want[1], slots)
    got = torch.zeros(2, 8, 16, kv_heads, dim + 4, dtype=torch.int8)
    ops.store_kv(k, v, got[0], got[1], slots)
    assert all(torch.equal(a, b) for a, b in zip(got, to_kernel_layout(*want)))
    read = from_cache_dtype(want[0].view(-1, kv_heads, dim + 4)[slots], torch.float32)
    bad = (~k.float().isfinite()).any(-1, keepdim=True).expand_as(k)     # rows with a NaN or an infinity
    assert read[bad].isnan().all() and read[~bad].isfinite().all()
