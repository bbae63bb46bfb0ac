"""A small byte-level BPE tokenizer trained locally (no downloads), with ChatML-style special tokens
and chat template, written in the HF format (tokenizer.json + tokenizer_config.json)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, IM_START, IM_END]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_WORDS = (
    "the a an of to in is was for on that with as by at from it this be are or not have has had "
    "ferry river boat harbor dock wind water light morning evening night day week year time people "
    "model token cache block layer attention query key value server request stream batch prefill "
    "decode gateway worker balancer redis nats message latency throughput memory compute matrix "
    "one two three four five six seven eight nine ten hundred thousand first second last next "
    "red green blue black white small large long short fast slow new old good great high low "
    "say go make know think take see come want look use find give tell work call try ask need "
    "hello world please thanks yes no maybe user assistant system question answer story poem "
)


def _corpus() -> list[str]:
    """Deterministic pseudo-text: every pair of words, plus digits and punctuation, so BPE learns
    merges across the whole printable range without any downloaded data."""
    words = _WORDS.split()
    lines = []
    for i, w in enumerate(words):
        tail = " ".join(words[(i * 7 + k) % len(words)] for k in range(12))
        lines.append(f'{w.capitalize()} {tail}, {i} {i * 37 % 1000}! {w.upper()}? ({w}) - "{w}s".')
    return lines * 4


def train_tokenizer(vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: Path) -> None:
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "model_max_length": 131072,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    special_map = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2))
