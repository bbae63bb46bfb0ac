"""MoE: the routed experts run as one grouped matmul, matching a per-token reference, with no host sync."""

from __future__ import annotations

import pytest
import torch
from host_sync import watch_host_syncs

from ferry.model.config import config_from_hf
from ferry.model.make_model import hf_config
from ferry.model.moe import MoE

pytestmark = pytest.mark.unit


def _cfg():
    return config_from_hf(hf_config("deepseek-v3", "tiny", {"bos": 1, "eos": 2, "pad": 0}))


def _moe(seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(_cfg())
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.2)
    return moe


def _per_token_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    ids, weights = moe.gate(x)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(ids[t].tolist(), weights[t]):
            out[t] += w.to(x.dtype) * moe.experts[e](x[t : t + 1])[0]
    return out + moe.shared_experts(x)


@pytest.mark.parametrize("fused", [False, True], ids=["stacked-per-call", "fused"])
@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_grouped_experts_match_the_per_token_sum(fused, tokens):
    moe = _moe()
    x = torch.randn(tokens, moe.gate.weight.shape[1])
    with torch.inference_mode():
        expected = _per_token_reference(moe, x)
        if fused:
            moe.fuse()
        got = moe(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_fuse_shares_the_experts_memory_and_keeps_the_state_dict():
    moe = _moe()
    names = sorted(moe.state_dict())
    moe.fuse()
    assert sorted(moe.state_dict()) == names
    first = moe.experts[0]
    assert first.gate_proj.weight.data_ptr() == moe.grouped.gate_up.data_ptr()
    assert first.down_proj.weight.data_ptr() == moe.grouped.down.data_ptr()
    first.fuse()  # the model-wide fuse reaches the experts too: they stay views of the stack
    assert first.gate_up is None


def test_the_moe_forward_never_syncs_with_the_host():
    """No .tolist()/.item()/bincount: on a GPU nothing waits for the device mid-layer."""
    moe = _moe()
    moe.fuse()
    x = torch.randn(5, moe.gate.weight.shape[1])
    with torch.inference_mode(), watch_host_syncs() as syncs:
        moe(x)
    assert syncs == []
