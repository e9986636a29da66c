"""flash-linear-attention is used only for bf16/fp16 activations: it asserts on float32, so a
float32 model on CUDA with fla installed used to fail in its first Gated DeltaNet step."""
from __future__ import annotations

import pytest
import torch

from flashrt.nn.linear_attn import chunk_gated_delta_rule, recurrent_gated_delta_rule, use_fla


@pytest.mark.parametrize("fast,dtype,want", [
    (True, torch.bfloat16, True), (True, torch.float16, True), (True, torch.float32, False),
    (False, torch.bfloat16, False), (False, torch.float32, False)])
def test_use_fla(fast, dtype, want):
    assert use_fla(fast, dtype) is want


@pytest.mark.parametrize("rule,T", [(chunk_gated_delta_rule, 9), (recurrent_gated_delta_rule, 1)])
def test_float32_with_fast_kernels_asked_stays_on_torch(rule, T):
    """fast=True (what GatedDeltaNet passes on CUDA when fla imports) with float32 inputs runs the
    torch rule: same bits as fast=False. Before, it called fla (here: not installed, so a crash)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(T, 2, 16, generator=g) for _ in range(3))
    gate, beta = -torch.rand(T, 2, generator=g), torch.rand(T, 2, generator=g)
    s0 = torch.randn(2, 16, 16, generator=g) * 0.1
    sa, sb = s0.clone(), s0.clone()
    oa = rule(q, k, v, gate, beta, sa, fast=False)
    ob = rule(q, k, v, gate, beta, sb, fast=True)
    assert torch.equal(oa, ob) and torch.equal(sa, sb) and not torch.equal(sa, s0)
