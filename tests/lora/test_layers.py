"""The LoRA linear (nanopaged/lora/layers.py): each row gets its own adapter's update, the fused projections'
parts theirs, a part an adapter leaves alone nothing; the bfloat16 kernel's update stays close to F.linear's
and gives a row the same bits at every row count and beside any other adapters."""
import pytest
import torch
from torch import nn

from nanopaged.lora.adapter import LoRAAdapter
from nanopaged.lora.layers import Dpbf16SlotWeights, LoRALinear, SlotWeights, StepAdapters

IN, Q, KV, RANK = 64, 64, 32, 8


def adapter(int_id, parts, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    widths = {"q_proj": Q, "k_proj": KV, "v_proj": KV}
    weights = {(0, p): (torch.randn(RANK, IN, generator=g, dtype=torch.float32).to(dtype),
                        torch.randn(widths[p], RANK, generator=g, dtype=torch.float32).to(dtype)) for p in parts}
    return LoRAAdapter(f"a{int_id}", int_id, RANK, 0.5, weights)


def qkv_layer(base, slots=2, ops=None):
    step = StepAdapters([])
    return LoRALinear(base, 0, ("q_proj", "k_proj", "v_proj"), [Q, KV, KV], slots, step, torch.device("cpu"),
                      ops), step


def test_each_row_gets_its_adapters_update_part_by_part():
    torch.manual_seed(0)
    base = nn.Linear(IN, Q + 2 * KV, bias=False)
    layer, step = qkv_layer(base)
    a, b = adapter(1, ["q_proj", "v_proj"]), adapter(2, ["k_proj"], seed=1)
    layer.load(0, a)
    layer.load(1, b)
    x = torch.randn(5, IN)
    step.groups = [(0, torch.tensor([0, 3])), (1, torch.tensor([4]))]
    with torch.no_grad():
        got, plain = layer(x), base(x)
    for row, ad in ((0, a), (3, a), (4, b), (1, None), (2, None)):
        want = plain[row].clone()
        if ad is not None:
            start = 0
            for part, width in zip(("q_proj", "k_proj", "v_proj"), (Q, KV, KV)):
                if (0, part) in ad.weights:
                    A, B = ad.weights[(0, part)]
                    want[start:start + width] += B @ (A @ x[row]) * ad.scaling
                start += width
        torch.testing.assert_close(got[row], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[1], plain[1]) and torch.equal(got[2], plain[2])   # the base rows untouched


def test_an_adapter_without_this_projection_leaves_it_alone():
    layer, step = qkv_layer(nn.Linear(IN, Q + 2 * KV, bias=False))
    layer.load(0, LoRAAdapter("mlp", 1, RANK, 1.0, {(0, "down_proj"): (torch.ones(RANK, 128), torch.ones(IN, RANK))}))
    assert layer.slots[0] is None


def dpbf16_base():
    from nanopaged.cpu.build import available, cpu_ops
    if available() is not None or not cpu_ops().has_avx512_bf16:
        pytest.skip("nanopaged's bfloat16 kernel needs AVX512-BF16 and the C++ build")
    from nanopaged.cpu.linear import Dpbf16Linear
    torch.manual_seed(0)
    return Dpbf16Linear(nn.Linear(IN, Q + 2 * KV, bias=False).to(torch.bfloat16)), cpu_ops()


def test_the_bfloat16_kernels_update_is_close_to_f_linears():
    """The kernel expands only the parts the adapter has (q and v here); the reference reads a block-diagonal B."""
    base, ops = dpbf16_base()
    fast, _ = qkv_layer(base, ops=ops)
    ref, _ = qkv_layer(base)
    for layer in (fast, ref):
        layer.load(0, adapter(1, ["q_proj", "v_proj"], torch.bfloat16))
    assert isinstance(fast.slots[0], Dpbf16SlotWeights) and isinstance(ref.slots[0], SlotWeights)
    assert [(start, width) for _, start, width in fast.slots[0].parts] == [(0, Q), (Q + KV, KV)]
    x, rows = torch.randn(7, IN).to(torch.bfloat16), torch.arange(7)
    got, want = torch.zeros(7, Q + 2 * KV, dtype=torch.bfloat16), torch.zeros(7, Q + 2 * KV, dtype=torch.bfloat16)
    fast.slots[0].add_to(got, x, rows)
    ref.slots[0].add_to(want, x, rows)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-1)
    assert not got[:, Q:Q + KV].any()                     # k: left alone


def test_a_rows_result_is_the_same_bits_at_every_row_count_and_beside_any_adapter():
    base, ops = dpbf16_base()
    layer, step = qkv_layer(base, ops=ops)
    layer.load(0, adapter(1, ["q_proj", "v_proj"], torch.bfloat16))
    layer.load(1, adapter(2, ["q_proj", "k_proj", "v_proj"], torch.bfloat16, seed=3))
    x = torch.randn(33, IN).to(torch.bfloat16)
    slots = [i % 3 for i in range(33)]           # 2: the base model
    with torch.no_grad():
        step.groups = groups(slots)
        together = layer(x)
        for n in (1, 2, 5, 16, 33):
            for start in range(0, 33, n):
                step.groups = groups(slots[start:start + n])
                assert torch.equal(layer(x[start:start + n]), together[start:start + n])


def groups(slots):
    return [(s, torch.tensor([i for i, t in enumerate(slots) if t == s])) for s in (0, 1) if s in slots]


def test_the_fused_loops_update_is_the_layers_bit_for_bit():
    """csrc/decoder.cpp's LoraSlots::add runs LoRALinear.forward's ops: the same bits (an odd rank padded)."""
    base, ops = dpbf16_base()
    layer, step = qkv_layer(base, ops=ops)
    odd = adapter(2, ["k_proj"], torch.bfloat16, seed=5)
    odd.rank, odd.weights = 7, {k: (a[:7], b[:, :7]) for k, (a, b) in odd.weights.items()}
    layer.load(0, adapter(1, ["q_proj", "v_proj"], torch.bfloat16))
    layer.load(1, odd)
    x = torch.randn(9, IN).to(torch.bfloat16)
    step.groups = groups([0, 1, 2, 1, 0, 0, 2, 1, 1])
    with torch.no_grad():
        want = layer(x)
        got = base(x)
        layer.cpp_slots.add(got, x, step.groups)
    assert torch.equal(got, want) and not torch.equal(got, base(x))
