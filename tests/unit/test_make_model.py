"""`ferry make-model`: the CLI writes a loadable, random-marked checkpoint; sizes match BENCHMARKS.md."""

from __future__ import annotations

import json

import pytest
import torch

from ferry.cli import main
from ferry.model import load_model
from ferry.model.causal_lm import CausalLM
from ferry.model.config import config_from_hf
from ferry.model.make_model import ARCH_NAMES, hf_config

pytestmark = pytest.mark.unit
IDS = {"bos": 0, "eos": 1, "pad": 2}


@pytest.mark.parametrize("arch", sorted(ARCH_NAMES))
def test_cli_writes_loadable_random_checkpoint(arch, tmp_path):
    out = tmp_path / arch
    assert main(["make-model", "--arch", arch, "--size", "tiny", str(out)]) == 0
    names = {p.name for p in out.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors",
    } <= names
    assert json.loads((out / "config.json").read_text())["ferry_random_weights"] is True
    lm = load_model(out)
    assert lm.is_random and lm.config.arch == arch.replace("-", "_")
    assert sum(p.numel() for p in lm.model.parameters()) < 2_000_000  # tiny: tests stay fast
    assert "<|im_start|>user" in lm.tokenizer.apply_chat_template([{"role": "user", "content": "x"}])


def test_seed_changes_weights(tmp_path):
    for seed in (0, 1):
        main(["make-model", "--seed", str(seed), str(tmp_path / str(seed))])
    a, b = (load_model(tmp_path / s).model.state_dict() for s in "01")
    assert not torch.equal(a["model.layers.0.self_attn.q_proj.weight"], b["model.layers.0.self_attn.q_proj.weight"])


def test_bench_size_is_the_benchmark_llama():
    cfg = config_from_hf(hf_config("llama", "bench", IDS))
    assert (
        cfg.hidden_size,
        cfg.num_layers,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.intermediate_size,
        cfg.vocab_size,
        cfg.dtype,
    ) == (512, 8, 8, 4, 1408, 2048, "float32")
    with torch.device("meta"):
        params = sum(p.numel() for p in CausalLM(cfg).parameters())
    assert 20e6 < params < 30e6


def test_unknown_size_is_rejected():
    with pytest.raises(ValueError, match="size"):
        hf_config("llama", "huge", IDS)
