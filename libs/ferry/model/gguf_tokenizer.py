"""The tokenizer a GGUF file describes (`tokenizer.ggml.*` metadata), built with `tokenizers`, plus its
chat template (`tokenizer.chat_template`) rendered by ferry's Tokenizer with jinja2.

Two kinds (`tokenizer.ggml.model`): 'gpt2', byte-level BPE (GPT-2, Llama 3, Qwen2, SmolLM, ...), whose
split before BPE follows `tokenizer.ggml.pre`, the name llama.cpp gives each family's regex; and
'llama', SentencePiece BPE (Llama 2, Mistral 7B): '▁' for spaces, bytes as <0xNN> tokens, merges from
the file or, when it has none, from the piece scores (a merge ranks as the piece it makes).
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

UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4  # llama.cpp token types
SPACE = "\u2581"  # SentencePiece's visible space
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
    tokens: list[str] = list(f.field("tokenizer.ggml.tokens"))
    types: list[int] = list(f.field("tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = f.field("tokenizer.ggml.merges", None)
    if kind == "gpt2":
        backend = _byte_level_bpe(tokens, list(merges or []), str(f.field("tokenizer.ggml.pre", "default")))
    elif kind == "llama":
        scores = list(f.field("tokenizer.ggml.scores", [0.0] * len(tokens)))
        pairs = _merge_pairs(merges) if merges else merges_from_scores(tokens, scores)
        backend = _sentencepiece_bpe(tokens, types, pairs, bool(f.field("tokenizer.ggml.add_space_prefix", True)))
    else:
        raise ValueError(f"{f.path}: tokenizer.ggml.model {kind!r} is not supported ('gpt2' and 'llama' are)")
    _add_special_tokens(backend, tokens, types)
    specials = {name: _token(f, tokens, key) for name, key in _SPECIALS.items()}
    add_bos = f.field("tokenizer.ggml.add_bos_token", kind == "llama")  # llama.cpp's default for SentencePiece
    if add_bos and specials["bos_token"] is not None:
        bos = specials["bos_token"]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))]
        )
    return Tokenizer(backend, specials, f.field("tokenizer.chat_template", None))


def _merge_pairs(merges: list[str]) -> list[tuple[str, str]]:
    """GGUF spells each merge as one "left right" string; BPE takes the pair."""
    return [(left, right) for left, right in (m.split(" ", 1) for m in merges)]


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str) -> HFTokenizer:
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    # llama.cpp keeps a few tokens spelled as text (added ones); BPE needs every token in the byte alphabet
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode()): i for i, t in enumerate(tokens)}
    backend = HFTokenizer(models.BPE(vocab, _merge_pairs(merges), ignore_merges=pre in _IGNORE_MERGES))
    backend.pre_tokenizer = _pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(
    tokens: list[str], types: list[int], merges: list[tuple[str, str]], add_space_prefix: bool
) -> HFTokenizer:
    unk = next((t for t, k in zip(tokens, types) if k == UNKNOWN), None)
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = HFTokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    prepend = "first" if add_space_prefix else "never"
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme=prepend, split=False)
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces of the vocabulary is a merge; merges rank by the made
    piece's score (higher first), then by longer left and right parts (the order transformers uses)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found = []
    for piece, score in zip(tokens, scores):
        local = [
            (piece[:i], piece[i:], score) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab
        ]
        found += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


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
