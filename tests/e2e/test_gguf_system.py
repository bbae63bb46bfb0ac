"""`ferry up --model file.gguf`: the gateway reads the GGUF's tokenizer, the workers its weights, and the
system answers as the engine does in-process on the same file; /v1/models says what is served."""

from __future__ import annotations

import gguf
import openai
import pytest
from gguf_files import checkpoint_to_gguf
from system_launch import start_system

from ferry.engine import EngineConfig, LLMEngine
from ferry.model.make_model import make_model
from ferry.protocol import SamplingParams

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
PROMPT = "hello ferry world, the river"


def _engine_text(path, max_tokens: int) -> str:
    engine = LLMEngine.from_model_path(path, EngineConfig(num_kv_blocks=64))
    engine.add_request("r", engine.tokenizer.encode(PROMPT), SamplingParams(max_tokens=max_tokens, temperature=0.0))
    ids: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            ids += out.new_token_ids
    return engine.tokenizer.decode([i for i in ids if i not in engine.lm.eos_token_ids])


def test_ferry_up_serves_a_gguf_file(nats_url, redis_url, tmp_path):
    ckpt = make_model(tmp_path / "ckpt", "qwen2", "tiny", seed=7)
    path = checkpoint_to_gguf(ckpt, tmp_path / "tiny-qwen.Q8_0.gguf", gguf.GGMLQuantizationType.Q8_0)
    system = start_system(path, nats_url, redis_url, tmp_path / "run", prefill=1, decode=1)
    try:
        client = openai.OpenAI(base_url=f"{system.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
        card = client.models.list().data[0].model_dump()
        assert card["id"] == "tiny-qwen.Q8_0" and card["architecture"] == "qwen2"
        assert card["checkpoint_dtype"] == "Q8_0" and card["weights_dtype"] == "int8"  # auto keeps the Q8_0 codes
        reply = client.completions.create(model=card["id"], prompt=PROMPT, max_tokens=12, temperature=0)
        assert reply.choices[0].text == _engine_text(path, 12)
    finally:
        assert system.stop() == 0
