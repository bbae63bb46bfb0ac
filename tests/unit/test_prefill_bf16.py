"""A prefill step's activations kept in bf16 between the bf16 weight copies (quant_linear.BF16_ACTIVATIONS): the
switch, QuantLinear.bf16_forward, and a quantized model's prompt through gate/up -> SiLU -> down and q/k/v ->
attention -> o_proj in bf16, against the same model with every activation fp32 between the matmuls."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ferry.bench.quant_decode import all_position_logits
from ferry.kernels import cpu_prefill
from ferry.kernels import quant_linear as kernels
from ferry.kernels.cpu_decode import kernel
from ferry.kernels.quant_ref import quantize
from ferry.model import load_model
from ferry.model.make_model import make_model
from ferry.model.quant_linear import QuantLinear

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def kernel_ok():
    assert kernel() is not None, "the CPU kernels did not build (see the logged warning)"


@pytest.fixture(scope="module")
def tiny(kernel_ok, tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("prefill_bf16") / "tiny", "llama", "tiny", seed=0)


@pytest.mark.parametrize("name", ["FERRY_QUANT_BF16_ACTIVATIONS", "FERRY_QUANT_INT8_ACTIVATIONS"])
@pytest.mark.parametrize("value", ["yes", "2", ""])
def test_a_bad_activations_setting_is_refused_by_name(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        kernels._switch(name, "on", "off")


def test_bf16_activations_are_on_unless_switched_off(monkeypatch):
    monkeypatch.delenv("FERRY_QUANT_BF16_ACTIVATIONS", raising=False)
    assert kernels._switch("FERRY_QUANT_BF16_ACTIVATIONS", "on", "off")
    monkeypatch.setenv("FERRY_QUANT_BF16_ACTIVATIONS", "0")
    assert not kernels._switch("FERRY_QUANT_BF16_ACTIVATIONS", "on", "off")


def _layer(monkeypatch, bias: torch.Tensor | None = None) -> QuantLinear:
    monkeypatch.setattr(kernels, "BF16_COPY_FROM_ROWS", 24)
    layer = QuantLinear(quantize(torch.randn(48, 128, generator=torch.Generator().manual_seed(3)), 4, 32), bias)
    layer.backend = "cpu"
    layer.prepack()
    assert layer.bf16_copy is not None
    return layer


def test_bf16_forward_is_forward_without_the_widening_and_only_where_the_copy_multiplies(kernel_ok, monkeypatch):
    layer = _layer(monkeypatch)
    x = torch.randn(30, 128, generator=torch.Generator().manual_seed(4))
    low = layer.bf16_forward(x)
    assert low is not None and low.dtype == torch.bfloat16
    # the same fp32 sums, rounded once to bf16 (forward's fp32 out: unrounded from our AMX kernel, oneDNN's rounded)
    assert torch.equal(low, layer(x).to(torch.bfloat16))
    assert torch.equal(layer(x.bfloat16()), layer(x))  # bf16 rows in: the copy rounds fp32 rows to them anyway
    assert layer.bf16_forward(x[:23]) is None  # under BF16_COPY_FROM_ROWS: the int kernel's fp32
    monkeypatch.setattr(kernels, "BF16_ACTIVATIONS", False)
    assert layer.bf16_forward(x) is None
    monkeypatch.setattr(kernels, "BF16_ACTIVATIONS", True)
    assert _layer(monkeypatch, torch.ones(48)).bf16_forward(x) is None  # a bias is added in fp32: forward's


@pytest.mark.parametrize("num_tokens, bf16_expected", [(64, True), (20, False)])
def test_a_quantized_prompt_attends_and_multiplies_in_bf16_and_agrees_with_fp32_activations(
    tiny, monkeypatch, num_tokens, bf16_expected
):
    monkeypatch.setattr(kernels, "BF16_COPY_FROM_ROWS", 24)
    lm = load_model(tiny, weights_dtype="int8")
    ids = torch.randint(0, lm.config.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(5)).tolist()
    monkeypatch.setattr(kernels, "BF16_ACTIVATIONS", False)
    fp32_between = all_position_logits(lm, ids)
    monkeypatch.setattr(kernels, "BF16_ACTIVATIONS", True)
    seen: list[torch.dtype] = []  # the dtype prompt attention ran in, through torch's SDPA or our C++ kernel

    def spy(attend):
        def attend_and_note(q, *args, **kwargs):
            seen.append(q.dtype)
            return attend(q, *args, **kwargs)

        return attend_and_note

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy(F.scaled_dot_product_attention))
    monkeypatch.setattr(cpu_prefill, "prefill_attention", spy(cpu_prefill.prefill_attention))
    bf16_between = all_position_logits(lm, ids)
    expected = torch.bfloat16 if bf16_expected else torch.float32
    assert seen and set(seen) == {expected}  # prompt attention in bf16 from BF16_COPY_FROM_ROWS rows only
    assert bf16_between.dtype == torch.float32
    if not bf16_expected:
        assert torch.equal(bf16_between, fp32_between)  # under the row count nothing changes, bit for bit
        return
    assert not torch.equal(bf16_between, fp32_between)  # the switch happened
    agree = (bf16_between.argmax(-1) == fp32_between.argmax(-1)).float().mean()
    assert agree >= 0.9, agree
    torch.testing.assert_close(bf16_between.softmax(-1), fp32_between.softmax(-1), atol=0.02, rtol=0)


@pytest.mark.parametrize("value", ["sjf", "", "FCFS"])
def test_a_bad_prefill_order_is_refused_by_name(monkeypatch, value):
    from ferry.engine.config import EngineConfig, resolve_prefill_order

    monkeypatch.setenv("FERRY_PREFILL_ORDER", value)
    with pytest.raises(ValueError, match="FERRY_PREFILL_ORDER"):
        resolve_prefill_order(None)
    with pytest.raises(ValueError, match="prefill_order"):
        EngineConfig(prefill_order=value)


def test_prefill_order_defaults_to_shortest_first_and_the_setting_switches_the_engines_scheduler(tiny, monkeypatch):
    from ferry.engine.config import EngineConfig, resolve_prefill_order
    from ferry.engine.llm_engine import LLMEngine

    lm = load_model(tiny)
    monkeypatch.delenv("FERRY_PREFILL_ORDER", raising=False)
    assert resolve_prefill_order(None) == "shortest" and LLMEngine(lm, EngineConfig()).scheduler.shortest_first
    assert not LLMEngine(lm, EngineConfig(prefill_order="fcfs")).scheduler.shortest_first
    monkeypatch.setenv("FERRY_PREFILL_ORDER", "fcfs")
    assert not LLMEngine(lm, EngineConfig()).scheduler.shortest_first
