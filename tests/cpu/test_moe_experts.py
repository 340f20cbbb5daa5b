"""The grouped experts (cpu/moe.py, csrc/moe.cpp) against the reference loop (models/moe.py:
SparseMoeBlock.forward) on the same routing: float32 exactly, bfloat16 on nanopaged's kernels
exactly too (the same kernels on the same rows, the sum in the same order), and the 8- and 4-bit
experts; on random routings with ties in the router, experts nobody chose, one token and
thousands. A row's result does not depend on the rows beside it, and the load counts are the
reference's."""
import copy

import pytest
import torch
from torch import nn

from nanopaged.cpu.build import available
from nanopaged.cpu.fused import describe
from nanopaged.cpu.moe import GroupedMoeBlock, group_experts
from nanopaged.models.moe import MoEConfig, SparseMoeBlock, expert_load

pytestmark = pytest.mark.skipif(available() is not None, reason=f"{available()}")
HIDDEN = 64


def make_block(experts=8, top_k=2, intermediate=64, dtype=torch.float32, norm=True, float32_weights=False,
               seed=0):
    torch.manual_seed(seed)
    moe = MoEConfig(experts, top_k, intermediate, norm, float32_weights, frozenset())
    block = SparseMoeBlock(HIDDEN, moe)
    for p in block.parameters():
        nn.init.normal_(p, std=0.2)
    return block.to(dtype).eval()


def kernels(block, kind):
    """The block with its experts' linears on a CPU kernel: dpbf16, int8 or int4 (the router stays)."""
    from nanopaged.cpu.linear import Dpbf16Linear
    from nanopaged.cpu.quantized_linear import quantized_linear
    for expert in block.experts:
        for name in ("gate_up_proj", "down_proj"):
            dense = getattr(expert, name)
            new = Dpbf16Linear(dense) if kind == "dpbf16" else quantized_linear(kind, dense, 32, None)
            setattr(expert, name, new)
    return block


def both(block, x):
    """(reference output, grouped output) on the same input, the grouped block around the same one."""
    grouped = GroupedMoeBlock(block, describe)
    with torch.inference_mode():
        return block(x), grouped(x)


def needs_bf16_kernel():
    from nanopaged.cpu.choose import own_kernel_builds
    if not own_kernel_builds("dpbf16"):
        pytest.skip("no AVX512-BF16 here: nanopaged's bfloat16 kernel does not run")


@pytest.mark.parametrize("tokens", [1, 7, 300, 3000])
@pytest.mark.parametrize("experts, top_k, intermediate, norm", [(8, 2, 64, True), (16, 4, 32, False),
                                                                 (4, 4, 48, True)])
def test_grouped_experts_equal_the_reference_loop_in_float32(tokens, experts, top_k, intermediate, norm):
    """Every expert chosen by every token (top-4 of 4), experts no token chose (one token, top-2 of 8)."""
    block = make_block(experts, top_k, intermediate, norm=norm, seed=tokens)
    x = torch.randn(tokens, HIDDEN)
    ref, fast = both(block, x)
    assert torch.equal(ref, fast)


def test_ties_in_the_router_and_an_unchosen_expert():
    """Four experts with the same router row score every token alike (top-k breaks the tie the same
    way for both: they share route()); an expert whose row scores every token lowest is never chosen."""
    block = make_block(8, 2)
    with torch.no_grad():
        block.gate.weight[1:5] = block.gate.weight[1]
        block.gate.weight[7] = -block.gate.weight.abs().max() - 1    # below every other row on inputs >= 0
    x = torch.randn(50, HIDDEN).abs()
    ref, fast = both(block, x)
    assert torch.equal(ref, fast)
    weights, chosen = block.route(x)
    assert 7 not in chosen.unique().tolist()
    assert len({*chosen.flatten().tolist()} & {1, 2, 3, 4}) > 0


@pytest.mark.parametrize("float32_weights", [False, True])      # Mixtral keeps the routing weights in float32
@pytest.mark.parametrize("tokens", [1, 5, 200, 2000])
def test_grouped_bfloat16_experts_on_the_dpbf16_kernel_equal_the_reference(tokens, float32_weights):
    needs_bf16_kernel()
    block = kernels(make_block(16, 4, 64, torch.bfloat16, float32_weights=float32_weights, seed=tokens), "dpbf16")
    ref, fast = both(block, torch.randn(tokens, HIDDEN, dtype=torch.bfloat16))
    assert torch.equal(ref, fast)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_grouped_quantized_experts_equal_the_reference(kind):
    block = kernels(make_block(8, 2, 64, torch.bfloat16), kind)
    ref, fast = both(block, torch.randn(100, HIDDEN, dtype=torch.bfloat16))
    assert torch.equal(ref, fast)


def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    needs_bf16_kernel()
    block = GroupedMoeBlock(kernels(make_block(16, 4, 64, torch.bfloat16), "dpbf16"), describe)
    x = torch.randn(257, HIDDEN, dtype=torch.bfloat16)
    with torch.inference_mode():
        together = block(x)
        for i in (0, 100, 256):
            assert torch.equal(block(x[i:i + 1]), together[i:i + 1])
        assert torch.equal(block(x[50:90]), together[50:90])


def test_group_experts_swaps_every_block_and_counts_the_reference_load():
    model = nn.Sequential(make_block(8, 2), nn.Identity(), make_block(8, 2, seed=1))
    reference = copy.deepcopy(model)
    assert group_experts(model, describe) == 2 and all(isinstance(m, GroupedMoeBlock) for m in (model[0], model[2]))
    x = torch.randn(40, HIDDEN)
    with torch.inference_mode():
        assert torch.equal(model(x), reference(x))
    assert expert_load(model) == expert_load(reference)
    assert sum(expert_load(model)["tokens_per_expert"][0]) == 40 * 2
