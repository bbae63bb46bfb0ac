"""ModelConfig from a GGUF file's metadata (`<arch>.block_count`, `<arch>.attention.head_count`, ...)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ferry.model.config import ModelConfig

if TYPE_CHECKING:
    from ferry.model.gguf_reader import GgufFile


def config_from_gguf(f: GgufFile) -> ModelConfig:
    hidden = int(f.arch_field("embedding_length"))
    num_heads = int(f.arch_field("attention.head_count"))
    num_layers = int(f.arch_field("block_count"))
    window = f.arch_field("attention.sliding_window", None)
    try:
        return ModelConfig(
            arch=f.arch,
            vocab_size=_vocab_size(f),
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(f.arch_field("attention.head_count_kv", num_heads)),
            head_dim=int(f.arch_field("attention.key_length", hidden // num_heads)),
            intermediate_size=int(f.arch_field("feed_forward_length")),
            max_position_embeddings=int(f.arch_field("context_length", 4096)),
            rms_norm_eps=float(f.arch_field("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(f.arch_field("rope.freq_base", 10000.0)),
            rope_scaling=_rope_scaling(f),
            tie_word_embeddings=not f.has_tensor("output.weight"),
            qkv_bias=f.has_tensor("blk.0.attn_q.bias"),
            o_bias=f.has_tensor("blk.0.attn_output.bias"),
            sliding_windows=(int(window),) * num_layers if window and f.arch == "mistral" else (),
            dtype="float32",
            bos_token_id=f.field("tokenizer.ggml.bos_token_id", None),
            eos_token_ids=_eos_ids(f),
            raw={"gguf": f.path.name, "name": f.field("general.name", f.path.stem), "gguf_file_type": f.file_type},
        )
    except ValueError as exc:
        raise ValueError(f"{f.path}: {exc}") from None


def _vocab_size(f: GgufFile) -> int:
    size = f.arch_field("vocab_size", None)
    if size is None:
        size = len(f.field("tokenizer.ggml.tokens"))
    return int(size)


def _eos_ids(f: GgufFile) -> tuple[int, ...]:
    """EOS plus the end-of-turn tokens llama.cpp stops at (eot, eom), in that order, once each."""
    ids = [f.field(f"tokenizer.ggml.{key}_token_id", None) for key in ("eos", "eot", "eom")]
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def _rope_scaling(f: GgufFile) -> dict[str, Any] | None:
    if f.has_tensor("rope_freqs.weight"):  # Llama 3.x: per-frequency divisors, computed by the converter
        return {"rope_type": "factors", "factors": [float(x) for x in f.float_tensor("rope_freqs.weight")]}
    kind = f.arch_field("rope.scaling.type", "none")
    if kind == "none":
        return None
    factor = float(f.arch_field("rope.scaling.factor", 1.0))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        original = f.arch_field("rope.scaling.original_context_length", None)
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    raise ValueError(f"{f.arch}.rope.scaling.type: unsupported {kind!r}")
