"""The whole engine through the Triton kernels (TRITON_INTERPRET=1 on the CPU) gives the same greedy tokens
as the CPU path, on the tiny Llama, Qwen2 and DeepSeek-V3 (MLA, MoE), with the model's KV cache and
with a bf16 cache under the fp32 model; and a mixed forward on that path never reads the device."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # before the kernels are defined (see test_kernels.py)
    os.environ["TRITON_INTERPRET"] = "1"

from host_sync import watch_host_syncs

from ferry.engine.config import EngineConfig
from ferry.engine.llm_engine import LLMEngine
from ferry.model import AttentionMetadata, load_model
from ferry.model.make_model import make_model
from ferry.protocol import SamplingParams

pytestmark = pytest.mark.unit
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
# lengths so that one prompt prefills in two chunks (max_num_batched_tokens) beside decoding ones
PROMPTS = [[(11 * i + 3 * j) % 400 + 5 for j in range(n)] for i, n in enumerate((5, 37, 18))]


@pytest.fixture(scope="module", params=["llama", "qwen2", "deepseek-v3"])
def lm(request, tmp_path_factory):
    path = make_model(tmp_path_factory.mktemp(request.param) / "tiny", request.param, "tiny", seed=4)
    return load_model(path, device=DEVICE)


def _generate(lm, attention: str, kv_cache_dtype: str | None) -> list[list[int]]:
    config = EngineConfig(
        num_kv_blocks=32,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        device=DEVICE,
        attention=attention,
        kv_cache_dtype=kv_cache_dtype,
    )
    engine = LLMEngine(lm, config)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, GREEDY)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return list(tokens.values())


@pytest.mark.parametrize("kv_cache_dtype", [None, "bfloat16"], ids=["model-dtype-kv", "bf16-kv"])
def test_triton_engine_gives_the_torch_engine_tokens(lm, kv_cache_dtype):
    torch_tokens = _generate(lm, "torch", kv_cache_dtype)
    assert _generate(lm, "triton", kv_cache_dtype) == torch_tokens
    assert all(len(t) == GREEDY.max_tokens for t in torch_tokens)


def test_a_mixed_triton_forward_never_reads_the_device(lm):
    lm.model.set_attention_backend("triton")
    kv = lm.model.make_kv_cache(16, 16)
    steps = [([9, 20], [0, 0], [[0], [1, 2]]), ([1, 7, 3], [9, 20, 0], [[0], [1, 2], [3]])]
    for query_lens, context_lens, tables in steps:
        ids = [5 + i for i in range(sum(query_lens))]
        (ids, pos), meta = AttentionMetadata.build_with_inputs(query_lens, context_lens, tables, 16, ids, DEVICE)
        with watch_host_syncs() as syncs:
            logits = lm.model(ids, pos, meta, kv)
        assert syncs == [] and logits.shape == (len(query_lens), lm.config.vocab_size)
