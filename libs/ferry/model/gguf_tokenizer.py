"""The tokenizer a GGUF file describes (`tokenizer.ggml.*` metadata), built with `tokenizers`, plus its
chat template (`tokenizer.chat_template`) rendered by ferry's Tokenizer with jinja2.

Byte-level BPE (`tokenizer.ggml.model` = 'gpt2': GPT-2, Llama 3, Qwen2, SmolLM, ...) is supported; the
text split before BPE follows `tokenizer.ggml.pre`, the name llama.cpp gives each family's regex.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from ferry.model.tokenizer import Tokenizer

if TYPE_CHECKING:
    from ferry.model.gguf_reader import GgufFile

log = logging.getLogger(__name__)

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}
_IGNORE_MERGES = ("llama-bpe", "llama3", "smaug-bpe")  # a word already in the vocabulary is one token
_SPECIALS = {"bos_token": "bos", "eos_token": "eos", "pad_token": "padding", "unk_token": "unknown"}


def tokenizer_from_gguf(f: GgufFile) -> Tokenizer:
    kind = f.field("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{f.path}: tokenizer.ggml.model {kind!r} is not supported (byte-level BPE 'gpt2' is)")
    tokens: list[str] = list(f.field("tokenizer.ggml.tokens"))
    types: list[int] = list(f.field("tokenizer.ggml.token_type", [1] * len(tokens)))
    pre = str(f.field("tokenizer.ggml.pre", "default"))
    backend = _byte_level_bpe(tokens, list(f.field("tokenizer.ggml.merges")), pre)
    _add_special_tokens(backend, tokens, types)
    specials = {name: _token(f, tokens, key) for name, key in _SPECIALS.items()}
    if f.field("tokenizer.ggml.add_bos_token", False) and specials["bos_token"] is not None:
        bos = specials["bos_token"]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))]
        )
    return Tokenizer(backend, specials, f.field("tokenizer.chat_template", None))


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str) -> HFTokenizer:
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    # llama.cpp keeps a few tokens spelled as text (added ones); BPE needs every token in the byte alphabet
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode()): i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = HFTokenizer(models.BPE(vocab, pairs, ignore_merges=pre in _IGNORE_MERGES))
    backend.pre_tokenizer = _pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    return backend


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in _SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # SmolLM: digits one by one, then GPT-2's split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre not in ("gpt2", "default"):
        log.warning("tokenizer.ggml.pre %r: no split rule known for it, using GPT-2's", pre)
    return byte_level


def _add_special_tokens(backend: HFTokenizer, tokens: list[str], types: list[int]) -> None:
    """Control tokens (<|im_start|>, ...) stay whole and are special; user-defined ones stay whole."""
    control = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == CONTROL]
    backend.add_special_tokens(control)
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED]
    backend.add_tokens(user)


def _token(f: GgufFile, tokens: list[str], key: str) -> str | None:
    token_id = f.field(f"tokenizer.ggml.{key}_token_id", None)
    return None if token_id is None or not 0 <= token_id < len(tokens) else tokens[int(token_id)]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map: printable Latin-1 bytes stand for themselves, the
    rest are shifted to code points from 256 on."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in keep}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping
