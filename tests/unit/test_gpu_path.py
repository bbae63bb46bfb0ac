"""The GPU code path, proven on the CPU: the attention backend is resolved once (FERRY_ATTENTION=torch on
a GPU never reaches the CPU-only C++ kernel), the whole forward runs on a non-CPU device (meta: any
host read or CPU tensor mixed in raises), cuda:N calls run under a device guard, and block sizes the
kernels cannot take are refused when the engine is configured."""

from __future__ import annotations

import contextlib

import pytest
import torch

from ferry.engine import EngineConfig
from ferry.engine import device as engine_device
from ferry.kernels import resolve_attention
from ferry.model import AttentionMetadata
from ferry.model.causal_lm import CausalLM
from ferry.model.config import config_from_hf
from ferry.model.make_model import hf_config

pytestmark = pytest.mark.unit
IDS = {"bos": 1, "eos": 2, "pad": 0}
# a mixed step: two prefills (one on a cached context) and two decodes
STEP = dict(
    query_lens=[7, 1, 5, 1], context_lens=[0, 9, 16, 40], block_tables=[[1], [2, 9], [3, 4, 5], [6, 7, 8, 10, 11, 12]]
)


@pytest.mark.parametrize(
    "device,choice,backend",
    [
        ("cuda", "torch", "torch"),  # the bug: this reached the CPU kernel
        ("cuda:1", "auto", "triton"),
        ("cuda", None, "triton"),
        ("cpu", "auto", "cpu"),
        ("cpu", "torch", "cpu"),
        ("cpu", "triton", "triton"),
        ("meta", "torch", "torch"),
    ],
)
def test_the_backend_follows_device_and_choice(device, choice, backend, monkeypatch):
    monkeypatch.delenv("FERRY_ATTENTION", raising=False)
    assert resolve_attention(device, choice) == backend


def test_an_unknown_choice_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("FERRY_ATTENTION", "flash")
    with pytest.raises(ValueError, match="FERRY_ATTENTION='flash'"):
        resolve_attention("cpu")
    with pytest.raises(ValueError, match="attention"):
        EngineConfig(attention="flash")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "deepseek-v3"])
def test_the_torch_backend_runs_a_mixed_step_off_the_cpu(arch):
    """The whole model on the meta device (the stand-in for a GPU here): FERRY_ATTENTION=torch on a GPU
    takes the plain-torch path; a host read (.item/.tolist), a data-dependent shape or a CPU tensor
    mixed into the forward would raise."""
    cfg = config_from_hf(hf_config(arch, "tiny", IDS))
    with torch.device("meta"):
        model = CausalLM(cfg)
    model.set_attention_backend(resolve_attention("meta", "torch"))
    kv = model.make_kv_cache(16, 8, device="meta")
    (ids, pos), meta = AttentionMetadata.build_with_inputs(**STEP, block_size=8, input_ids=[5] * 14, device="meta")
    logits = model(ids, pos, meta, kv)
    assert logits.shape == (4, cfg.vocab_size) and logits.device.type == "meta"


def test_a_cuda_index_runs_every_step_under_that_device(monkeypatch):
    entered = []

    @contextlib.contextmanager
    def fake_cuda_device(index):
        entered.append(index)
        yield

    monkeypatch.setattr(torch.cuda, "device", fake_cuda_device)
    with engine_device.device_guard("cuda:1"):
        pass
    with engine_device.device_guard("cpu"), engine_device.device_guard("cuda"):
        pass
    assert entered == [1]


def test_the_engine_steps_inside_its_device_guard(tmp_path, monkeypatch):
    from ferry.engine import runner
    from ferry.engine.llm_engine import LLMEngine
    from ferry.model.make_model import make_model
    from ferry.protocol import SamplingParams

    guarded = []

    @contextlib.contextmanager
    def recording_guard(device):
        guarded.append(device)
        yield

    monkeypatch.setattr(runner, "device_guard", recording_guard)
    engine = LLMEngine.from_model_path(make_model(tmp_path, "llama", "tiny"), EngineConfig(num_kv_blocks=8))
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=2, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    assert guarded.count("cpu") >= 3  # the cache allocation, then every step


@pytest.mark.parametrize("block_size,device", [(12, "cpu"), (24, "cuda"), (8, "cuda:1")])
def test_block_sizes_the_kernels_cannot_take_are_refused_at_configuration(block_size, device):
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(block_size=block_size, device=device)


def test_the_engine_resolves_its_backend_once(tmp_path, monkeypatch):
    from ferry.engine.llm_engine import LLMEngine
    from ferry.model.make_model import make_model

    monkeypatch.setenv("FERRY_ATTENTION", "torch")
    engine = LLMEngine.from_model_path(make_model(tmp_path, "llama", "tiny"), EngineConfig(num_kv_blocks=8))
    monkeypatch.setenv("FERRY_ATTENTION", "triton")  # read at construction only: this changes nothing
    assert engine.runner.attention_backend == "cpu"
    assert {layer.self_attn.backend for layer in engine.lm.model.model.layers} == {"cpu"}


class _CountingEnviron(dict):
    """os.environ stand-in that counts every read."""

    num_reads = 0

    def __getitem__(self, key):
        type(self).num_reads += 1
        return super().__getitem__(key)

    def get(self, key, default=None):
        type(self).num_reads += 1
        return super().get(key, default)

    def __contains__(self, key):
        type(self).num_reads += 1
        return super().__contains__(key)


@pytest.mark.parametrize("cpu_kernels", ["1", "0"])
def test_the_forward_reads_no_environment_variable(cpu_kernels, tmp_path, monkeypatch):
    """FERRY_CPU_KERNELS (like FERRY_ATTENTION) is resolved once, into the backend every module holds: the
    steps read nothing from os.environ, and switching the variable afterwards changes nothing."""
    import os

    from ferry.engine.llm_engine import LLMEngine
    from ferry.model.make_model import make_model
    from ferry.protocol import SamplingParams

    monkeypatch.setenv("FERRY_CPU_KERNELS", cpu_kernels)
    engine = LLMEngine.from_model_path(make_model(tmp_path, "llama", "tiny"), EngineConfig(num_kv_blocks=8))
    backend = "cpu" if cpu_kernels == "1" else "torch"
    assert engine.runner.attention_backend == backend
    assert {m.backend for m in engine.lm.model.modules() if hasattr(m, "backend")} == {backend}
    engine.add_request("r", [5, 6, 7, 8], SamplingParams(max_tokens=3, temperature=0.0))
    counting = _CountingEnviron(os.environ, FERRY_CPU_KERNELS="1" if cpu_kernels == "0" else "0")
    monkeypatch.setattr(os, "environ", counting)
    while engine.has_unfinished_requests():
        engine.step()
    assert _CountingEnviron.num_reads == 0
