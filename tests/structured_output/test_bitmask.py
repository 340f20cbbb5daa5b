"""The step's mask: nanopaged's lookup-table unpacking (bitmask.py) equals xgrammar's own kernel,
touches only the constrained rows, and leaves the tensor it is given as it was."""
import pytest
import torch

xgr = pytest.importorskip("xgrammar", reason="the structured extra: pip install -e '.[structured]'")

from nanopaged.structured_output.bitmask import apply_token_bitmask, byte_table  # noqa: E402


def reference(logits, bitmask, rows):
    """xgrammar's apply_token_bitmask_inplace, on a copy, with bitmask row i for logits row rows[i]."""
    out = logits.clone()
    full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32)
    full[rows] = bitmask
    xgr.apply_token_bitmask_inplace(out, full, indices=rows)
    return out


@pytest.mark.parametrize("vocab", [32, 49152, 1000, 51])           # whole words, and a last word half used
@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [1, 3], [2]])
def test_the_lookup_table_mask_equals_xgrammars_kernel(vocab, rows):
    g = torch.Generator().manual_seed(vocab + len(rows))
    logits = torch.randn(4, vocab, generator=g)
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(rows), (vocab + 31) // 32), dtype=torch.int32, generator=g)
    bitmask[:, 0] |= 1                                       # every row keeps a token
    before = logits.clone()
    masked = apply_token_bitmask(logits, bitmask, rows)
    assert torch.equal(masked, reference(logits, bitmask, rows))
    assert torch.equal(logits, before)                       # a new tensor: the caller's is left as it was
    untouched = [r for r in range(4) if r not in rows]
    assert torch.equal(masked[untouched], logits[untouched])


def test_a_bit_is_a_token():
    logits = torch.zeros(1, 64)
    bitmask = torch.tensor([[0b101, -2**31]], dtype=torch.int32)      # tokens 0, 2 and 63 (the sign bit)
    allowed = torch.isfinite(apply_token_bitmask(logits, bitmask, [0]))[0].nonzero().flatten().tolist()
    assert allowed == [0, 2, 63]


def test_the_table_unpacks_one_byte_into_eight_tokens():
    table = byte_table(torch.device("cpu"))
    assert table.shape == (256, 8) and table[0].eq(float("-inf")).all() and table[255].eq(0).all()
    assert torch.isfinite(table[0b10000001]).tolist() == [True, False, False, False, False, False, False, True]
