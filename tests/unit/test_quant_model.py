"""Weights kept in int8 / int4 (--weights-dtype): what load_model holds, that the model still computes the
same function, that the kernel path and the reference agree token for token, and that differently held
weights never share a KV namespace."""

from __future__ import annotations

import json

import pytest
import torch

from ferry.bench.quant_decode import all_position_logits
from ferry.engine.config import EngineConfig
from ferry.engine.llm_engine import LLMEngine
from ferry.model import load_model
from ferry.model.cpu_linear import FusedProjection, Linear
from ferry.model.make_model import make_model
from ferry.model.quant_linear import QuantLinear, quantized_bytes
from ferry.protocol import SamplingParams

pytestmark = pytest.mark.unit
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("quant") / "tiny", "llama", "tiny", seed=0)


def _greedy(lm, prompts: list[list[int]]) -> list[list[int]]:
    eng = LLMEngine(lm, EngineConfig(num_kv_blocks=64))
    for i, prompt in enumerate(prompts):
        eng.add_request(f"r{i}", prompt, GREEDY)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while eng.has_unfinished_requests():
        for step in eng.step():
            out[step.request_id] += step.new_token_ids
    return [out[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("weights_dtype", ["int8", "int4"])
def test_every_projection_is_held_quantized(tiny, weights_dtype):
    lm = load_model(tiny, weights_dtype=weights_dtype)
    modules = list(lm.model.modules())
    fused = [v for m in modules for v in vars(m).values() if isinstance(v, FusedProjection)]
    assert not [m for m in modules if isinstance(m, Linear)] and not fused
    quant = [m for m in modules if isinstance(m, QuantLinear)]
    assert len(quant) == 4 * lm.config.num_layers + 1  # qkv, o, gate_up, down per layer + lm_head
    assert {m.qw.bits for m in quant} == {8 if weights_dtype == "int8" else 4}
    fp32 = load_model(tiny)
    fp32_bytes = sum(p.numel() * 4 for n, p in fp32.model.named_parameters() if "norm" not in n and "embed" not in n)
    assert quantized_bytes(lm.model) < fp32_bytes / (3 if weights_dtype == "int8" else 5)
    assert lm.weights_dtype == weights_dtype and lm.model.model.embed_tokens.weight.dtype == torch.float32


@pytest.mark.parametrize("weights_dtype, worst", [("int8", 0.02), ("int4", 0.25)])
def test_quantized_logits_stay_close_to_fp32(tiny, weights_dtype, worst):
    ids = list(range(5, 69))
    ref = all_position_logits(load_model(tiny), ids)
    got = all_position_logits(load_model(tiny, weights_dtype=weights_dtype), ids)
    relative = (got - ref).norm(dim=-1) / ref.norm(dim=-1)  # [T]
    assert relative.max() < worst, relative.max()
    assert relative.max() > 0  # the weights really changed


@pytest.mark.parametrize("weights_dtype", ["int8", "int4"])
def test_kernel_and_reference_give_the_same_greedy_tokens(tiny, weights_dtype, monkeypatch):
    lm = load_model(tiny, weights_dtype=weights_dtype)
    prompts = [list(range(7, 7 + n)) for n in (3, 17, 40)]
    fast = _greedy(lm, prompts)
    monkeypatch.setenv("FERRY_CPU_KERNELS", "0")  # every op, the quantized matmul included, in plain torch
    assert _greedy(lm, prompts) == fast


def test_weights_dtype_names_the_kv_namespace(tiny):
    names = {
        wd: LLMEngine(load_model(tiny, weights_dtype=wd), EngineConfig(num_kv_blocks=8)).kv_namespace
        for wd in ("auto", "float32", "int8", "int4")
    }
    assert names["auto"] == names["float32"]  # the checkpoint is fp32: the same weights
    assert len({names["float32"], names["int8"], names["int4"]}) == 3
    assert "int8" in names["int8"] and "int4" in names["int4"]


def test_bad_weights_dtype_settings_are_refused(tiny):
    with pytest.raises(ValueError, match="weights_dtype"):
        load_model(tiny, weights_dtype="int3")
    with pytest.raises(ValueError, match="disagree"):
        load_model(tiny, dtype="float32", weights_dtype="bfloat16")
    with pytest.raises(ValueError, match="weights_dtype"):
        EngineConfig(weights_dtype="fp8")
    assert load_model(tiny, weights_dtype="bfloat16").model.lm_head.weight.dtype == torch.bfloat16


def test_worker_setting_and_cli_flags_reach_the_engine(tiny, monkeypatch, capsys):
    import argparse

    from ferry.engine import generate_cli
    from ferry.launcher import up
    from ferry_services.worker.service import build_engine
    from ferry_services.worker.settings import WorkerSettings

    monkeypatch.setenv("FERRY_WEIGHTS_DTYPE", "int4")
    engine = build_engine(WorkerSettings(model=str(tiny), num_kv_blocks=8))
    assert engine.lm.weights_dtype == "int4" and "int4" in engine.kv_namespace

    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    specs = up.plan_services(parser.parse_args(["--weights-dtype", "int8"]), tiny, "nats://x:1", "redis://x:1")
    assert {s.env.get("FERRY_WEIGHTS_DTYPE") for s in specs if s.kind == "worker"} == {"int8"}

    parser = argparse.ArgumentParser()
    generate_cli.add_arguments(parser)
    argv = ["--model", str(tiny), "--prompt", "hi", "--max-tokens", "4", "--temperature", "0", "--ignore-eos"]
    assert generate_cli.run(parser.parse_args([*argv, "--json", "--weights-dtype", "int8"])) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 4
